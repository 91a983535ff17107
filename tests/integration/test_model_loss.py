"""A model's own loss: a forward that returns ``F.cross_entropy`` / ``F.nll_loss``.

Under torch 2.13 the joint capture on meta tensors lost the backward of ``aten::nll_loss``
(pipeline/stages/trace/composite.py: a Python meta kernel made the Python dispatcher send
its autograd key to the not-implemented fallback), and such a model was refused. Real
tracing throughout, no mocks:

1. a tiny module of the user's whose forward returns ``F.cross_entropy(logits, labels)``
   (``model.loss=output``, labels one of ``model.inputs``) plans at mesh 2x4 with its
   backward (``nll_loss_backward`` in the graph, a gradient output for every parameter)
   and ``python -m pipeline.verify`` passes on it at 2x2: the loss and every gradient of
   the executed plan equal the single-process step (eager CPU, ``loss.backward()``);
2. the ``F.nll_loss`` variant plans likewise;
3. tiny ``hf/gpt2`` with ``model.loss=output`` (transformers' own loss, given
   ``labels=``: shifted labels through ``F.cross_entropy``) plans at 2x4 and verifies at
   2x2;
4. a loss whose backward truly vanishes (an op registered without a derivative; a
   detached loss, which gives an inference graph with no gradient outputs at all) is
   still refused with one line naming the first parameter, exit 2, nothing written;
5. the capture's dispatch fix touches only the ops it must and is undone on exit.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

#: The user's file (written to a directory outside the package, imported once).
_USER_FILE = textwrap.dedent('''
    """Modules that compute their own loss."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    # An op registered without a derivative: a loss through it has no backward.
    _LIB = torch.library.Library("loss_models_test", "FRAGMENT")
    _LIB.define("square(Tensor x) -> Tensor")
    _LIB.impl("square", lambda x: x * x, "CompositeExplicitAutograd")


    class Block(nn.Module):
        def __init__(self, dim, hidden):
            super().__init__()
            self.norm = nn.LayerNorm(dim)
            self.up = nn.Linear(dim, hidden)
            self.down = nn.Linear(hidden, dim)

        def forward(self, x):
            return x + self.down(F.gelu(self.up(self.norm(x))))


    class CrossEntropyLM(nn.Module):
        """tokens, labels [B, T] -> the mean cross-entropy, computed by the model."""

        def __init__(self, vocab=48, dim=16, hidden=32, layers=2):
            super().__init__()
            self.embed = nn.Embedding(vocab, dim)
            self.blocks = nn.ModuleList(Block(dim, hidden) for _ in range(layers))
            self.norm = nn.LayerNorm(dim)
            self.head = nn.Linear(dim, vocab, bias=False)

        def logits(self, tokens):
            h = self.embed(tokens)
            for block in self.blocks:
                h = block(h)
            return self.head(self.norm(h))

        def forward(self, tokens, labels):
            return F.cross_entropy(self.logits(tokens).flatten(0, 1), labels.flatten())


    class NllLM(CrossEntropyLM):
        def forward(self, tokens, labels):
            logp = F.log_softmax(self.logits(tokens), dim=-1)
            return F.nll_loss(logp.flatten(0, 1), labels.flatten())


    class NoDerivativeLM(CrossEntropyLM):
        def forward(self, tokens, labels):
            return torch.ops.loss_models_test.square(self.logits(tokens)).mean()


    class DetachedLM(CrossEntropyLM):
        def forward(self, tokens, labels):
            return F.cross_entropy(self.logits(tokens).detach().flatten(0, 1),
                                   labels.flatten())
''')

INPUTS = ("model.inputs=[{name:tokens,shape:[8,12],dtype:int64,high:48},"
          "{name:labels,shape:[8,12],dtype:int64,high:48}]")
#: Slow hardware without a kernel floor (tests/test_verify.py): the plans shard.
SLOW = ("hardware.kernel_floor_us=0.0", "hardware.hbm_bandwidth=1e9",
        "hardware.peak_flops_fp32=1e9", "hardware.peak_flops_bf16=1e9")
#: 2 blocks x (norm 2, up 2, down 2) + embed + norm 2 + head
CUSTOM_PARAMS = 16
GPT2 = ("model=hf/gpt2", "model.config.n_layer=1", "model.config.n_embd=12",
        "model.config.n_head=2", "model.config.n_positions=16", "model.config.vocab_size=48",
        "model.config.resid_pdrop=0", "model.config.embd_pdrop=0",
        "model.config.attn_pdrop=0", "model.seq_len=12", "model.batch_size=8",
        "model.loss=output")


def _custom(cls: str) -> list[str]:
    return ["model=custom", f"model.builder._target_=loss_models_test_user.{cls}",
            "model.loss=output", INPUTS, *SLOW]


@pytest.fixture(scope="module")
def user_dir(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The user's directory holding ``loss_models_test_user.py``, on ``sys.path`` (its
    op registration makes it a module imported once per session)."""
    path = tmp_path_factory.mktemp("loss_user")
    (path / "loss_models_test_user.py").write_text(_USER_FILE)
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(path))
        yield path


def _plan(overrides: list[str]) -> tuple[Any, Any]:
    """trace .. solve of a config in this process (no report)."""
    from pipeline.config import load_resolved, stage_dirs
    from pipeline.stages.runner import run_stage

    cfg = load_resolved(overrides)
    dirs = stage_dirs(cfg)
    for stage in ("trace", "topology", "costs", "solve"):
        run_stage(stage, cfg, dirs)
    return cfg, dirs


def _check_backward(dirs: Any, n_params: int) -> dict[str, int]:
    """The graph holds the loss's backward and one gradient output per parameter; the
    solve wrote a plan with a finite objective. Returns the op counts of the graph."""
    graph = pq.read_table(Path(dirs.trace) / "graph.parquet").to_pylist()
    ops: dict[str, int] = {}
    for row in graph:
        if row["kind"] == "call_function":
            ops[row["target"]] = ops.get(row["target"], 0) + 1
    assert ops.get("aten.nll_loss_forward.default") == 1
    assert ops.get("aten.nll_loss_backward.default") == 1
    assert ops.get("aten._log_softmax_backward_data.default") == 1
    out = json.loads(graph[-1]["output_desc"])
    grads = [d["grad_of"] for d in out if d["kind"] == "grad"]
    assert len(grads) == n_params and all(grads)
    params = [r["fqn"] for r in graph if r["role"] == "param"]
    assert sorted(grads) == sorted(params)
    run = json.loads((Path(dirs.solve) / "run.json").read_text())
    assert run["objective"] > 0 and run["placement_hash"]
    return ops


def test_cross_entropy_in_forward_plans_and_verifies(user_dir: Path, tmp_path: Path) -> None:
    """1: ``F.cross_entropy`` in the forward plans at 2x4; verify passes at 2x2."""
    from pipeline.verify.run import RTOL
    from pipeline.verify.run import main as verify_main

    results = tmp_path / "results"
    _, dirs = _plan([*_custom("CrossEntropyLM"), "mesh=2x4", f"results_dir={results}"])
    _check_backward(dirs, CUSTOM_PARAMS)
    assert verify_main([*_custom("CrossEntropyLM"), "mesh=2x2",
                        f"results_dir={results}"]) == 0
    record = json.loads(next(results.rglob("2x2-*/**/verify.json")).read_text())
    assert record["ok"] and record["processes"] == 4
    assert len(record["grads"]) == CUSTOM_PARAMS and not record["grads_missing"]
    assert all(g["rel_diff"] <= RTOL for g in record["grads"].values())
    assert record["loss"]["rel_diff"] <= RTOL
    assert record["collectives"]["counted"], "the plan shards nothing: a vacuous check"


def test_nll_loss_in_forward_plans(user_dir: Path, tmp_path: Path) -> None:
    """2: ``F.log_softmax`` + ``F.nll_loss`` in the forward plans at 2x4."""
    _, dirs = _plan([*_custom("NllLM"), "mesh=2x4", f"results_dir={tmp_path}"])
    _check_backward(dirs, CUSTOM_PARAMS)


def test_hf_gpt2_own_loss_plans_and_verifies(tmp_path: Path) -> None:
    """3: transformers' own loss (``model.loss=output``, the forward given ``labels=``)
    plans at 2x4 with its backward, and verifies at 2x2 against the eager step."""
    pytest.importorskip("transformers")
    from pipeline.verify.run import RTOL, verify

    _, dirs = _plan([*GPT2, "mesh=2x4", f"results_dir={tmp_path}"])
    ops = _check_backward(dirs, 2 + 12 + 2)  # wte (tied with lm_head), wpe, 1 block, ln_f
    assert ops.get("aten.constant_pad_nd.default") == 1  # the shifted labels
    cfg, _ = _plan([*GPT2, *SLOW, "mesh=2x2", f"results_dir={tmp_path}"])
    record = verify(cfg)
    assert record["ok"], record.get("error") or record["checks"]
    assert all(g["rel_diff"] <= RTOL for g in record["grads"].values())
    assert len(record["grads"]) == 16 and record["loss"]["rel_diff"] <= RTOL


def _main(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str]:
    from pipeline.__main__ import main

    with pytest.raises(SystemExit) as exc:
        main(argv)
    return int(exc.value.code), capsys.readouterr().err.strip()


@pytest.mark.filterwarnings("ignore:loss_models_test::square. an autograd kernel")
@pytest.mark.parametrize("cls", ["NoDerivativeLM", "DetachedLM"])
def test_vanished_backward_refused(user_dir: Path, tmp_path: Path, cls: str,
                                   capsys: pytest.CaptureFixture) -> None:
    """4: a loss through an op without a derivative (torch warns, every gradient output
    None) or of detached logits (no gradient outputs at all): one line, exit 2."""
    results = tmp_path / "results"
    code, err = _main([*_custom(cls), "mesh=2x4", f"results_dir={results}"], capsys)
    assert code == 2
    last = err.splitlines()[-1]
    assert last.startswith("embed.weight: the captured training step has no gradient"), err
    assert f"({CUSTOM_PARAMS} of {CUSTOM_PARAMS} have none)" in last
    assert not list(results.rglob("graph.parquet"))


def test_composite_fix_scope() -> None:
    """5: the ops lifted are the composite ops that lose their derivative on meta
    (``nll_loss``, ``var``, ``relu6``), not those with a derivative of their own
    (``_fused_rms_norm``) or a Python autograd kernel (``dropout``); the Python meta
    kernels are back after the block, also after an error."""
    import torch
    from torch._C import DispatchKey

    from pipeline.stages.trace.composite import (
        composite_autograd_on_meta,
        ops_losing_autograd_on_meta,
    )

    aten = torch.ops.aten
    lifted = {op for op, _ in ops_losing_autograd_on_meta()}
    assert {aten.nll_loss.default, aten.var.dim, aten.relu6.default} <= lifted
    assert not {aten._fused_rms_norm.default, aten.dropout.default} & lifted
    before = aten.nll_loss.default.py_kernels[DispatchKey.Meta]
    with pytest.raises(RuntimeError, match="inside"):
        with composite_autograd_on_meta() as count:
            assert count == len(lifted)
            assert DispatchKey.Meta not in aten.nll_loss.default.py_kernels
            raise RuntimeError("inside")
    assert aten.nll_loss.default.py_kernels[DispatchKey.Meta] is before
    assert {op for op, _ in ops_losing_autograd_on_meta()} == lifted

"""Depth-independent tracing: trace 4 repeated blocks, stamp the middle one up to depth N.

The joint graph of a model whose N repeated blocks (a ``ModuleList``: ``layers``,
``model.layers``, ``transformer.h``) are copies of one block is, up to the block index,
the same graph at every depth: the first block, N-2 copies of a middle block, the last
block, and the nodes outside the blocks. :func:`trace_model` of :mod:`pipeline.stages.trace.stage`
therefore traces a copy of the model truncated to its first 4 blocks (first, two middles,
last) and :func:`stamp` rewrites that graph IR into the IR of the N-block model, row for
row the table a full trace writes.

**Eligibility** (:func:`short_model_plan`, before tracing): exactly one container of
repeated blocks with at least 5 blocks, every block structurally identical (module tree
with names and types; parameter and buffer names, shapes, dtypes, ``requires_grad``;
every plain public attribute of every submodule except the layer index, ``layer_idx`` /
``layer_id``), no tied parameter inside a block, and no per-layer list of length N with
unequal entries in a transformers config (``layer_types`` alternating sliding and full
attention).

**Proof conditions** (:func:`stamp`, on the 4-block IR; anything else: full trace):

* The ``layer`` labels form *runs* of consecutive equal labels, and the runs labelled
  with a block form *sweeps*, maximal sequences of block runs, each exactly one run per
  block ascending 0,1,2,3 or descending 3,2,1,0, the 4 runs of a sweep of one length.
* Unlabelled runs between two runs of one block, all of one phase (Mixtral's expert
  backward, ops without a module path), count as that block's nodes in a second reading
  when the first fails; every condition below is checked again on that reading.
* Relative form of a node of block i: every column with the block index made relative
  (strings ``<blocks>.i`` in ``fqn``, ``module_path``, ``layer``) and every tensor
  reference ``{"node": j}`` written ``(layer(j) - i, ordinal of j in its block)`` or
  ``(none, ordinal of j among the unlabelled nodes)``; the FX name by its base. The two
  middle blocks have identical relative forms, node for node, references to the
  neighbouring blocks included; the first block equals them except where a middle
  refers to its predecessor (the first block refers to an unlabelled node there), the
  last block except where a middle refers to its successor. References reach at most
  the neighbouring block.
* Unlabelled nodes refer to blocks 0 and 3 only (stamped to 0 and N-1), never to a
  middle, and name no block in their strings, except the output node: its flat list
  (loss, then one gradient per parameter in parameter order) and ``output_desc`` hold
  one contiguous slice per block, ascending, the 4 slices of one relative form.
* FX names: ``base`` or ``base_<n>`` (torch/fx/graph.py ``_Namespace.create_name``,
  one counter per base, in creation order; nodes removed by dead-code elimination leave
  gaps). A node's number is the previous number of its base in graph order plus the
  gap its source node has in the 4-block IR; the middle blocks' gaps are equal.
* Self-check: stamping the 4-block IR to depth 4 gives back the 4-block IR exactly.

A forward that indexes the blocks up to the full depth (``self.blocks[i] for i in
range(n)``) fails on the truncated list with an ``IndexError``: full trace.

**Residual risk**: forward code that branches on the layer index itself beyond block 3
(``if self.layer_idx >= 8``, a config list read by index outside the blocks' own
attributes), or that reads the number of blocks from the list (``len(self.layers)``),
is invisible to both checks; ``stamp_layers=false`` traces in full.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from pipeline.core.ir import TENSOR_REF_RE as _REF_RE
from pipeline.stages.trace.layers import layer_of_path

__all__ = ["SHORT_LAYERS", "ShortModel", "StampError", "name_gaps", "names_from_gaps",
           "short_model_plan", "stamp", "truncate_blocks"]

#: Blocks of the truncated model: first, two middles, last.
SHORT_LAYERS = 4
#: Attributes holding the layer index (built-in LLaMA has none; transformers: layer_idx).
LAYER_INDEX_ATTRS: frozenset[str] = frozenset({"layer_idx", "layer_id", "layer_number"})
_NAME_RE = re.compile(r"^([a-zA-Z_][0-9a-zA-Z_]*?)(?:_(\d+))?$")
_PLAIN = (int, float, str, bool, type(None))


class StampError(Exception):
    """The 4-block IR does not prove the blocks identical; ``str(err)`` says why (the
    trace stage then traces in full)."""


@dataclass
class ShortModel:
    """Where the repeated blocks of a built model are.

    Attributes:
        container: module path of the ``ModuleList`` (``layers``, ``model.layers``).
        n_layers: its length in the full model.
    """

    container: str
    n_layers: int


# --------------------------------------------------------------------------- eligibility


def _plain(value: Any) -> bool:
    import torch

    if isinstance(value, (tuple, list)):
        return all(_plain(v) for v in value)
    return isinstance(value, (*_PLAIN, torch.dtype))


def _block_signature(block: Any) -> tuple:
    """Everything about a block that could make its graph differ, but its index."""
    mods = []
    for name, mod in block.named_modules():
        attrs = tuple(sorted((k, repr(v)) for k, v in vars(mod).items()
                             if not k.startswith("_") and k not in LAYER_INDEX_ATTRS
                             and _plain(v)))
        mods.append((name, type(mod).__qualname__, type(mod).__module__, attrs))
    tensors = tuple(
        (kind, name, tuple(t.shape), str(t.dtype), bool(t.requires_grad))
        for kind, items in (("param", block.named_parameters()),
                            ("buffer", block.named_buffers()))
        for name, t in items)
    return tuple(mods), tensors


def _containers(module: Any) -> list[tuple[str, Any]]:
    """``(path, ModuleList)`` of each container whose children are repeated blocks (the
    child paths are the ``layer`` labels of :func:`pipeline.stages.trace.layers.layer_of_path`)."""
    import torch.nn as nn

    found = []
    for path, mod in module.named_modules():
        if not path or not isinstance(mod, nn.ModuleList) or len(mod) == 0:
            continue
        if all(layer_of_path(f"{path}.{i}") == f"{path}.{i}" for i in range(len(mod))):
            found.append((path, mod))
    return found


def _per_layer_config_lists(module: Any, n: int) -> str | None:
    """Name of a transformers config field holding one unequal entry per layer."""
    seen = set()
    for mod in module.modules():
        config = getattr(mod, "config", None)
        if config is None or id(config) in seen or not hasattr(config, "to_dict"):
            continue
        seen.add(id(config))
        for key, value in config.to_dict().items():
            if isinstance(value, (list, tuple)) and len(value) == n and len(
                    {json.dumps(v, sort_keys=True, default=repr) for v in value}) > 1:
                return key
    return None


def short_model_plan(module: Any, tied: dict[str, str]) -> tuple[ShortModel | None, str]:
    """``(ShortModel, "")`` when ``module`` may be traced short, else ``(None, why not)``.

    ``tied`` is :func:`pipeline.models.step.tied_parameters` of the full module.
    """
    found = _containers(module)
    if not found:
        return None, "no ModuleList of repeated blocks"
    if len(found) > 1:
        paths = ", ".join(p for p, _ in found)
        return None, f"{len(found)} containers of repeated blocks ({paths})"
    path, blocks = found[0]
    n = len(blocks)
    if n <= SHORT_LAYERS:
        return None, f"{n} blocks in {path} (stamping needs at least {SHORT_LAYERS + 1})"
    first = _block_signature(blocks[0])
    for i in range(1, n):
        if _block_signature(blocks[i]) != first:
            return None, f"block {path}.{i} differs from {path}.0 (modules, tensors or attributes)"
    prefix = path + "."
    for alias, canonical in tied.items():
        if alias.startswith(prefix) or canonical.startswith(prefix):
            return None, f"tied parameter {alias} = {canonical} inside the blocks"
    key = _per_layer_config_lists(module, n)
    if key is not None:
        return None, f"config field {key} differs between layers"
    return ShortModel(container=path, n_layers=n), ""


def truncate_blocks(module: Any, plan: ShortModel) -> None:
    """Keep the first :data:`SHORT_LAYERS` blocks of ``plan.container`` (in place)."""
    import torch.nn as nn

    parent_path, _, leaf = plan.container.rpartition(".")
    parent = module.get_submodule(parent_path) if parent_path else module
    blocks = getattr(parent, leaf)
    setattr(parent, leaf, nn.ModuleList(list(blocks)[:SHORT_LAYERS]))


# --------------------------------------------------------------------------- stamping


class _Template:
    """The 4-block IR in relative form (see the module docstring)."""

    def __init__(self, table: pa.Table, container: str, attach: bool = False) -> None:
        self.cols = {name: table.column(name).to_pylist() for name in table.column_names}
        self.schema = table.schema
        self.n = table.num_rows
        self.block_re = re.compile(r"(?<![\w.])" + re.escape(container) + r"\.(\d+)(?!\d)")
        self.container = container
        labels = []
        for lab in self.cols["layer"]:
            if lab is None:
                labels.append(None)
                continue
            m = self.block_re.fullmatch(lab)
            if m is None:
                raise StampError(f"layer label {lab!r} is not a block of {container}")
            labels.append(int(m.group(1)))
        if attach:
            _attach_enclosed(labels, self.cols["phase"])
        self.label = labels
        self.ordinal: list[int] = []
        counts: dict[Any, int] = {}
        for lab in labels:
            self.ordinal.append(counts.get(lab, 0))
            counts[lab] = counts.get(lab, 0) + 1
        self.block_nodes = [[j for j in range(self.n) if labels[j] == b]
                            for b in range(SHORT_LAYERS)]
        if set(counts) - {None} != set(range(SHORT_LAYERS)):
            raise StampError(f"blocks labelled {sorted(k for k in counts if k is not None)}, "
                             f"expected 0..{SHORT_LAYERS - 1}")
        self.none_nodes = [j for j in range(self.n) if labels[j] is None]
        self.segments = self._segments()
        self.gaps = name_gaps(self.cols["name"])

    def _segments(self) -> list[tuple[str, Any]]:
        """Graph order as ``("none", [rows])`` and ``("sweep", (+1|-1, [[rows] per
        block in sweep order]))``."""
        runs: list[list] = []
        for j, lab in enumerate(self.label):
            if runs and runs[-1][0] == lab:
                runs[-1][1].append(j)
            else:
                runs.append([lab, [j]])
        segments: list[tuple[str, Any]] = []
        k = 0
        while k < len(runs):
            if runs[k][0] is None:
                segments.append(("none", runs[k][1]))
                k += 1
                continue
            sweep = []
            while k < len(runs) and runs[k][0] is not None:
                sweep.append(runs[k])
                k += 1
            order = [r[0] for r in sweep]
            if order == list(range(SHORT_LAYERS)):
                direction = 1
            elif order == list(range(SHORT_LAYERS))[::-1]:
                direction = -1
            else:
                raise StampError(f"a sweep over blocks {order} (expected one run per block, "
                                 "ascending or descending)")
            if len({len(r[1]) for r in sweep}) != 1:
                raise StampError(f"a sweep with runs of {[len(r[1]) for r in sweep]} nodes")
            segments.append(("sweep", (direction, [r[1] for r in sweep])))
        return segments

    # relative form ---------------------------------------------------------------

    def ref_token(self, target: int, block: int | None) -> tuple:
        lab = self.label[target]
        if lab is None:
            return ("none", self.ordinal[target])
        if block is None:
            return ("abs", lab, self.ordinal[target])
        return ("rel", lab - block, self.ordinal[target])

    def rel_text(self, text: str | None, block: int) -> str | None:
        if text is None:
            return None
        return self.block_re.sub(lambda m: f"{self.container}.<{int(m.group(1)) - block}>", text)

    def relative(self, j: int) -> tuple[tuple, list[tuple]]:
        """(relative form without references, reference tokens) of block node ``j``."""
        block = self.label[j]
        c = self.cols
        refs = [self.ref_token(int(x), block)
                for key in ("args", "kwargs") for x in _REF_RE.findall(c[key][j])]
        skeleton = tuple(
            _REF_RE.sub('{"node": ?}', c[key][j]) if key in ("args", "kwargs")
            else self.rel_text(c[key][j], block) if key in ("fqn", "module_path", "layer",
                                                           "output_desc")
            else self.gaps[j][0] if key == "name"
            else c[key][j]
            for key in c if key != "idx")
        return skeleton, refs


def _enclosed_runs(labels: list[int | None], phases: list[str]) -> list[tuple[int, int, int]]:
    """``(start, stop, block)`` of each unlabelled run between two runs of one block, all
    of one phase (the loss between the last block's forward and its backward is not)."""
    runs: list[list] = []
    for j, lab in enumerate(labels):
        if runs and runs[-1][0] == lab:
            runs[-1][2] = j + 1
        else:
            runs.append([lab, j, j + 1])
    out = []
    for k in range(1, len(runs) - 1):
        lab, start, stop = runs[k]
        if lab is not None or runs[k - 1][0] is None or runs[k - 1][0] != runs[k + 1][0]:
            continue
        if len(set(phases[start - 1:stop + 1])) == 1:
            out.append((start, stop, runs[k - 1][0]))
    return out


def _attach_enclosed(labels: list[int | None], phases: list[str]) -> None:
    """Count each unlabelled run between two runs of one block (one phase) as that
    block's nodes (Mixtral's expert backward: ops without a module path inside a block's
    backward); their ``layer`` column stays null."""
    for start, stop, block in _enclosed_runs(labels, phases):
        labels[start:stop] = [block] * (stop - start)


def _check_blocks(t: _Template) -> None:
    forms = [[t.relative(j) for j in nodes] for nodes in t.block_nodes]
    sizes = [len(f) for f in forms]
    if len(set(sizes)) != 1:
        raise StampError(f"blocks of {sizes} nodes")
    middle = forms[1]
    for k, (a, b) in enumerate(zip(forms[1], forms[2])):
        if a != b:
            raise StampError(f"middle blocks differ at node {k} of the block "
                             f"({t.cols['name'][t.block_nodes[1][k]]} vs "
                             f"{t.cols['name'][t.block_nodes[2][k]]})")
    for block, edge in ((0, -1), (SHORT_LAYERS - 1, 1)):
        for k, ((skel, refs), (mskel, mrefs)) in enumerate(zip(forms[block], middle)):
            name = t.cols["name"][t.block_nodes[block][k]]
            if skel != mskel or len(refs) != len(mrefs):
                raise StampError(f"block {block} differs from the middle blocks at {name}")
            for r, m in zip(refs, mrefs):
                if r != m and not (m[0] == "rel" and m[1] == edge and r[0] == "none"):
                    raise StampError(f"block {block} differs from the middle blocks in a "
                                     f"reference of {name}")
    for _skel, refs in middle:
        for r in refs:
            if r[0] == "rel" and abs(r[1]) > 1:
                raise StampError("a block refers to a block beyond its neighbours")
    for j in t.none_nodes:
        if t.cols["kind"][j] == "output":
            continue
        for key in ("args", "kwargs"):
            for x in _REF_RE.findall(t.cols[key][j]):
                lab = t.label[int(x)]
                if lab is not None and lab not in (0, SHORT_LAYERS - 1):
                    raise StampError(f"unlabelled node {t.cols['name'][j]} refers to middle "
                                     f"block {lab}")
        for key in ("fqn", "module_path", "output_desc"):
            text = t.cols[key][j]
            if text is not None and t.block_re.search(text):
                raise StampError(f"unlabelled node {t.cols['name'][j]} names a block in {key}")


def _output_layout(t: _Template, j: int) -> tuple[list, list, list[Any]]:
    """The output node's flat list split as (prefix, [slice per block], suffix) of
    ``(element, desc)`` pairs, checked to be one ascending sweep of equal slices."""
    args = json.loads(t.cols["args"][j])
    descs = json.loads(t.cols["output_desc"][j] or "[]")
    if len(args) != 1 or not isinstance(args[0], list) or len(args[0]) != len(descs):
        raise StampError("output node is not one flat list matching output_desc")
    elems = list(zip(args[0], descs))
    labels = []
    for elem, desc in elems:
        grad_of = desc.get("grad_of") if isinstance(desc, dict) else None
        m = t.block_re.match(grad_of) if isinstance(grad_of, str) else None
        labels.append(int(m.group(1)) if m else None)
        if m is None and _REF_RE.search(json.dumps(elem)):
            lab = t.label[int(_REF_RE.search(json.dumps(elem)).group(1))]
            if lab is not None and lab not in (0, SHORT_LAYERS - 1):
                raise StampError("output element outside the blocks refers to a middle block")
    firsts = [k for k, lab in enumerate(labels) if lab is not None]
    if not firsts:
        raise StampError("no output element of a block")
    lo, hi = firsts[0], firsts[-1] + 1
    inner = labels[lo:hi]
    if None in inner or inner != sorted(inner) or sorted(set(inner)) != list(range(SHORT_LAYERS)):
        raise StampError("output elements are not one ascending sweep over the blocks")
    slices = [[e for e, lab in zip(elems[lo:hi], inner) if lab == b] for b in range(SHORT_LAYERS)]

    def rel(pair: tuple, block: int) -> str:
        elem, desc = pair
        text = _REF_RE.sub(lambda m: json.dumps(list(t.ref_token(int(m.group(1)), block))),
                           json.dumps(elem))
        return text + "|" + t.rel_text(json.dumps(desc), block)

    forms = [[rel(p, b) for p in s] for b, s in enumerate(slices)]
    if any(f != forms[0] for f in forms[1:]):
        raise StampError("the blocks' output slices differ")
    for b, s in enumerate(slices):
        for elem, _ in s:
            for x in _REF_RE.findall(json.dumps(elem)):
                if t.label[int(x)] not in (b, None):
                    raise StampError("a block's output element refers to another block")
    return elems[:lo], slices, elems[hi:]


def _ref(idx: int) -> str:
    """A tensor reference as :func:`json.dumps` writes it."""
    return f'{{"node": {idx}}}'


def _sweep_blocks(direction: int, n_layers: int) -> list[tuple[int, int]]:
    """``(template block, stamped layer)`` in sweep order."""
    last = SHORT_LAYERS - 1
    asc = [(0, 0), *[(1, i) for i in range(1, n_layers - 1)], (last, n_layers - 1)]
    return asc if direction > 0 else asc[::-1]


def _build(t: _Template, n_layers: int) -> pa.Table:
    """The IR of ``n_layers`` blocks from the template (checks already made)."""
    last = SHORT_LAYERS - 1
    # Stamped rows: (template row, stamped layer or None).
    plan: list[tuple[int, int | None]] = []
    for kind, seg in t.segments:
        if kind == "none":
            plan.extend((j, None) for j in seg)
            continue
        direction, runs = seg
        by_block = {t.label[run[0]]: run for run in runs}
        for block, layer in _sweep_blocks(direction, n_layers):
            plan.extend((j, layer) for j in by_block[block])
    new_index: dict[tuple, int] = {}
    for i, (j, layer) in enumerate(plan):
        key = ("none", t.ordinal[j]) if layer is None else (layer, t.ordinal[j])
        new_index[key] = i

    def stamped_layer(block: int | None) -> int | None:
        if block is None:
            return None
        return {0: 0, last: n_layers - 1}.get(block, block)

    def target(ref: int, src_block: int | None, layer: int | None) -> int:
        lab = t.label[ref]
        if lab is None:
            return new_index[("none", t.ordinal[ref])]
        if layer is None:
            return new_index[(stamped_layer(lab), t.ordinal[ref])]
        return new_index[(layer + lab - src_block, t.ordinal[ref])]

    def text(value: str | None, block: int | None, layer: int | None) -> str | None:
        if value is None or block is None or block == layer:
            return value
        return t.block_re.sub(
            lambda m: f"{t.container}.{layer + int(m.group(1)) - block}", value)

    cols: dict[str, list] = {k: [] for k in t.cols}
    out_j = next((j for j in t.none_nodes if t.cols["kind"][j] == "output"), None)
    for i, (j, layer) in enumerate(plan):
        block = t.label[j]
        for key in t.cols:
            value = t.cols[key][j]
            if key == "idx":
                value = i
            elif key in ("args", "kwargs"):
                value = _REF_RE.sub(lambda m, b=block, L=layer: _ref(
                    target(int(m.group(1)), b, L)), value)
            elif key in ("fqn", "module_path", "layer", "output_desc"):
                value = text(value, block, layer)
            cols[key].append(value)
    if out_j is not None:
        prefix, slices, suffix = _output_layout(t, out_j)
        elems: list = []
        descs: list = []
        layer_of = [None] + [0, *range(1, n_layers - 1), n_layers - 1] + [None]
        blocks_of = [None] + [0, *[1] * (n_layers - 2), last] + [None]
        groups = [prefix] + [slices[b] for b in blocks_of[1:-1]] + [suffix]
        for group, block, layer in zip(groups, blocks_of, layer_of):
            for elem, desc in group:
                etext = _REF_RE.sub(lambda m, b=block, L=layer: _ref(
                    target(int(m.group(1)), b, L)), json.dumps(elem))
                elems.append(json.loads(etext))
                descs.append(json.loads(text(json.dumps(desc), block, layer)))
        i_out = plan.index((out_j, None))
        cols["args"][i_out] = json.dumps([elems])
        cols["output_desc"][i_out] = json.dumps(descs)
    _rename(t, plan, cols)
    return pa.table({k: pa.array(v, t.schema.field(k).type) for k, v in cols.items()},
                    schema=t.schema)


def name_gaps(names: list[str]) -> list[tuple[str, int]]:
    """``(base, gap)`` of each FX name in graph order: ``base`` or ``base_<n>`` (``n`` 0
    for a bare base), the gap being ``n`` minus the previous ``n`` of that base (0 before
    its first occurrence).

    Raises:
        StampError: a name that is not ``base[_n]`` or is numbered 0.
    """
    out = []
    previous: dict[str, int] = {}
    for name in names:
        m = _NAME_RE.match(name)
        if m is None:
            raise StampError(f"FX name {name!r} is not base[_n]")
        base, text = m.group(1, 2)
        num = 0 if text is None else int(text)
        if text is not None and num == 0:
            raise StampError(f"FX name {name!r} has number 0")
        out.append((base, num - previous.get(base, 0)))
        previous[base] = num
    return out


def names_from_gaps(gaps: list[tuple[str, int]]) -> list[str]:
    """The names of :func:`name_gaps` back: each base's counter advances by the gap
    (torch/fx/graph.py ``_Namespace.create_name``: one counter per base)."""
    current: dict[str, int] = {}
    names = []
    for base, gap in gaps:
        num = current.get(base, 0) + gap
        current[base] = num
        names.append(base if num == 0 else f"{base}_{num}")
    return names


def _rename(t: _Template, plan: list[tuple[int, int | None]], cols: dict[str, list]) -> None:
    """FX names of the stamped rows: the gaps of their template rows, counted on."""
    gaps = t.gaps
    for a, b in zip(t.block_nodes[1], t.block_nodes[2]):
        if gaps[a] != gaps[b]:
            raise StampError(f"FX name counters advance differently in the middle blocks "
                             f"({t.cols['name'][a]} vs {t.cols['name'][b]})")
    cols["name"] = names_from_gaps([gaps[j] for j, _layer in plan])


def _check_gaps_across_sweeps(t: _Template) -> None:
    """A counter gap that spans a whole sweep without a node of its base in that sweep
    could hold names of removed nodes of every block (a gap that grows with depth):
    only a gap of 1 (nothing removed in between) is accepted there."""
    spans = [(seg[1][0][0], seg[1][-1][-1]) for kind, seg in t.segments if kind == "sweep"]
    last: dict[str, int] = {}
    for j, (base, gap) in enumerate(t.gaps):
        p = last.get(base)
        last[base] = j
        if p is None or gap <= 1:
            continue
        if any(p < lo and hi < j for lo, hi in spans):
            raise StampError(f"FX name {t.cols['name'][j]} follows {t.cols['name'][p]} "
                             "across a sweep of the blocks with names skipped in between")


def stamp(short: pa.Table, container: str, n_layers: int) -> pa.Table:
    """The IR of the ``n_layers``-block model from the IR ``short`` of its first
    :data:`SHORT_LAYERS` blocks (``container``: the blocks' module path).

    Raises:
        StampError: the 4-block IR does not prove the blocks identical (module docstring).
    """
    if n_layers < SHORT_LAYERS:
        raise StampError(f"{n_layers} blocks (at least {SHORT_LAYERS} needed)")
    try:
        return _stamp(_Template(short, container), short, n_layers)
    except StampError as plain:
        block_re = re.compile(re.escape(container) + r"\.(\d+)")
        labels = [None if x is None or not block_re.fullmatch(x)
                  else int(block_re.fullmatch(x).group(1))
                  for x in short.column("layer").to_pylist()]
        if not _enclosed_runs(labels, short.column("phase").to_pylist()):
            raise
        # second reading: unlabelled runs inside a block belong to it; every check again
        try:
            return _stamp(_Template(short, container, attach=True), short, n_layers)
        except StampError as attached:
            raise StampError(f"{plain}; counting the unlabelled runs inside a block as "
                             f"its nodes: {attached}") from None


def _stamp(t: _Template, short: pa.Table, n_layers: int) -> pa.Table:
    _check_blocks(t)
    _check_gaps_across_sweeps(t)
    again = _build(t, SHORT_LAYERS)
    if not again.equals(short):
        raise StampError("stamping the 4-block IR to 4 blocks does not give it back")
    return _build(t, n_layers)

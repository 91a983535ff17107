"""The pipeline section of a plan file as verify reads it (pipeline/verify/pipelined.py,
``read_section``): a section written by hand for ``pp = 2`` and 4 layers is accepted,
and each way of breaking it (another schedule, a missing stage, a gap between layer
ranges, a stage on the wrong rank, the embedding on the wrong stage, layers short of
``model.n_layers``) is refused in one line naming the entry."""

from __future__ import annotations

import copy
import json

import pytest
from omegaconf import OmegaConf

from pipeline.plan.format import PlanFileError
from pipeline.verify.pipelined import expected_modules, read_section

CFG = OmegaConf.create({"mesh": [2], "mesh_names": ["pp"], "model": {"n_layers": 4},
                        "pipeline": {"schedule": "interleaved_1f1b", "microbatches": 4,
                                     "virtual_stages": 2}})
SECTION = {"degree": 2, "schedule": "interleaved_1f1b", "microbatches": 4,
           "virtual_stages": 2, "stages": [
               {"stage": 0, "rank": 0, "layers": [0, 1], "modules": ["tok_embeddings",
                                                                     "layers.0"]},
               {"stage": 1, "rank": 1, "layers": [1, 2], "modules": ["layers.1"]},
               {"stage": 2, "rank": 0, "layers": [2, 3], "modules": ["layers.2"]},
               {"stage": 3, "rank": 1, "layers": [3, 4], "modules": ["layers.3", "norm",
                                                                     "output"]}]}


def _write(tmp_path, section):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"pipeline": section}))
    return path


def test_expected_modules_by_hand():
    assert expected_modules(0, 2, True, False) == ["tok_embeddings", "layers.0", "layers.1"]
    assert expected_modules(2, 3, False, True) == ["layers.2", "norm", "output"]
    assert expected_modules(0, 1, True, True) == ["tok_embeddings", "layers.0", "norm",
                                                  "output"]


def test_a_good_section_is_read(tmp_path):
    assert read_section(_write(tmp_path, SECTION), CFG) == SECTION


def _broken(edit):
    s = copy.deepcopy(SECTION)
    edit(s)
    return s


@pytest.mark.parametrize("section, entry", [
    (_broken(lambda s: s.update(schedule="1f1b")), "pipeline.schedule='1f1b'"),
    (_broken(lambda s: s.update(microbatches=8)), "pipeline.microbatches=8"),
    (_broken(lambda s: s["stages"].pop()), "allowed 4 stages"),
    (_broken(lambda s: s["stages"][1].update(layers=[2, 2])), "pipeline.stages[1]"),
    (_broken(lambda s: s["stages"][2].update(rank=1)), "pipeline.stages[2]"),
    (_broken(lambda s: s["stages"][0]["modules"].remove("tok_embeddings")),
     "pipeline.stages[0].modules"),
    (_broken(lambda s: s["stages"][3].update(layers=[3, 5])), "pipeline.stages[3].modules"),
    (None, "no pipeline section"),
])
def test_a_broken_section_is_refused(tmp_path, section, entry):
    with pytest.raises(PlanFileError) as err:
        read_section(_write(tmp_path, section), CFG)
    text = str(err.value)
    assert len(text.splitlines()) == 1 and entry in text and "allowed" in text, text


def test_layers_short_of_the_model_are_refused(tmp_path):
    cfg = OmegaConf.merge(CFG, {"model": {"n_layers": 5}})
    with pytest.raises(PlanFileError, match=r"layers end at 4; allowed model.n_layers=5"):
        read_section(_write(tmp_path, SECTION), cfg)

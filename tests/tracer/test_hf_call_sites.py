"""Call sites of Hugging Face model calls that transformers or another installed library makes
for the program (docs/CONVENTIONS.md, "Call sites"): the model span, and the report's model
row, name the program's line."""

from __future__ import annotations

import contextlib
import importlib
import inspect
import io
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import mltrace
from mltrace.analysis.codepaths import location
from mltrace.run.levels import Level

transformers = pytest.importorskip("transformers")

#: An installed library that wraps a generating model (as peft's ``PeftModel.generate`` does).
_WRAPPER = '''"""A wrapper of a generating model, as installed libraries write them."""


class Wrapped:
    def __init__(self, model):
        self.model = model

    def generate(self, *args, **kwargs):
        return self.model.generate(*args, **kwargs)  # LIBRARY: generate
'''


def _line(tag: str) -> int:
    lines = inspect.getsource(sys.modules[__name__]).splitlines()
    return next(i for i, text in enumerate(lines, 1) if text.rstrip().endswith(f"# LINE: {tag}"))


def _site(span: Any) -> tuple[str, int]:
    return span.attrs["code.file.path"], span.attrs["code.line.number"]


def _report(run: Path, fmt: str) -> str:
    from mltrace.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["report", str(run), "--format", fmt, "--width", "400"]) == 0
    return buf.getvalue()


def test_the_report_names_the_line_that_called_a_library_method_of_the_model(tmp_path: Path) -> None:
    """``CLIPModel.get_image_features`` calls its vision tower and its projection itself (no
    ``CLIPModel.__call__``): both model calls, and the report's model rows, name the
    program's line that called it; the tower's layers keep their lines in transformers."""
    torch.manual_seed(0)
    tiny = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}
    config = transformers.CLIPConfig(
        text_config={**tiny, "vocab_size": 64, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 1},
        vision_config={**tiny, "image_size": 16, "patch_size": 8},
        projection_dim=8,
    )
    model = transformers.CLIPModel(config).eval()
    with mltrace.profile(output=tmp_path / "run", summary=False, level="layer"), torch.no_grad():
        for _ in range(2):
            model.get_image_features(pixel_values=torch.randn(1, 3, 16, 16))  # LINE: image features
    run = mltrace.load_run(tmp_path / "run")
    here = (__file__, _line("image features"))
    models = [s for s in run.spans if s.level == Level.MODEL]
    assert sorted(s.name for s in models) == ["CLIPModel.vision_model"] * 2 + ["CLIPModel.visual_projection"] * 2
    assert {_site(s) for s in models} == {here}
    embeddings = {_site(s) for s in run.spans if s.level == Level.LAYER and s.name.endswith("embeddings")}
    assert {Path(path).name for path, _ in embeddings} == {"modeling_clip.py"}
    data = json.loads(_report(tmp_path / "run", "json"))
    assert [m["source"] for m in data["models"]] == [f"{__file__}:{here[1]}"] * 2
    rows = [line for line in _report(tmp_path / "run", "text").splitlines() if line.startswith("│ CLIPModel.vision_model ")]
    assert rows and all(f"{location(*here)}  model.get_image_features(pixel_values=" in row for row in rows)


def test_a_generate_an_installed_library_calls_names_the_programs_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A library between the program and ``generate()`` (a wrapper model) is no call site
    either: the ``generate`` span and its model calls name the program's line."""
    root = tmp_path / "lib" / "site-packages"
    (root / "fakewrap").mkdir(parents=True)
    (root / "fakewrap" / "__init__.py").write_text(_WRAPPER)
    monkeypatch.syspath_prepend(str(root))
    sys.modules.pop("fakewrap", None)
    try:
        wrapped = importlib.import_module("fakewrap").Wrapped
    finally:
        sys.modules.pop("fakewrap", None)
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=500, n_positions=64)
    model = wrapped(transformers.GPT2LMHeadModel(config).eval())
    with mltrace.profile(output=tmp_path / "run", summary=False, level="model"), torch.no_grad():
        model.generate(torch.randint(0, 500, (1, 4)), max_new_tokens=2, do_sample=False, pad_token_id=0)  # LINE: wrapped generate
    run = mltrace.load_run(tmp_path / "run")
    (gen,) = [s for s in run.spans if s.name == "generate"]
    models = [s for s in run.spans if s.level == Level.MODEL]
    here = (__file__, _line("wrapped generate"))
    assert _site(gen) == here
    assert len(models) == 2 and {_site(s) for s in models} == {here}

"""Hugging Face generate() as a span over its model calls, and its token timings in the report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import mltrace
from mltrace.run.levels import Level

transformers = pytest.importorskip("transformers")


def _gpt2() -> object:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=500, n_positions=64)
    return transformers.GPT2LMHeadModel(config).eval()


def _generate(model: object, prompt: torch.Tensor, tokens: int) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(  # type: ignore[attr-defined,no-any-return]
            prompt, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0
        )  # LINE: generate call


def test_generate_parents_its_model_calls_and_leaves_the_output_alone(tmp_path: Path) -> None:
    model = _gpt2()
    prompt = torch.randint(0, 500, (1, 6))
    plain = _generate(model, prompt, 7)
    original = transformers.generation.utils.GenerationMixin.__dict__["generate"]
    with mltrace.profile(output=tmp_path / "run", summary=False, level="layer"):
        traced = _generate(model, prompt, 7)
    assert torch.equal(plain, traced)
    assert transformers.generation.utils.GenerationMixin.__dict__["generate"] is original  # put back at stop
    run = mltrace.load_run(tmp_path / "run")
    (gen,) = [s for s in run.spans if s.name == "generate"]
    assert gen.level == Level.USER and gen.attrs["ml.generate.model"] == "GPT2LMHeadModel"
    assert gen.attrs["ml.generate.new_tokens"] == 7 and gen.attrs["ml.generate.model_calls"] == 7
    assert gen.attrs["code.file.path"] == __file__
    steps = sorted((s for s in run.spans if s.level == Level.MODEL), key=lambda s: s.start_ns)
    assert [s.parent_id for s in steps] == [gen.id] * 7
    assert [s.attrs["ml.generate.step"] for s in steps] == list(range(7))
    assert [s.attrs["ml.generate.phase"] for s in steps] == ["prefill"] + ["decode"] * 6
    assert all(gen.start_ns <= s.start_ns and s.end_ns <= gen.end_ns for s in steps)


def test_the_report_gives_time_to_first_token_and_per_output_token(tmp_path: Path) -> None:
    import contextlib
    import io
    import statistics

    from mltrace.cli import main

    model = _gpt2()
    with mltrace.profile(output=tmp_path / "run", summary=False, level="layer"):
        _generate(model, torch.randint(0, 500, (2, 5)), 6)
    run = mltrace.load_run(tmp_path / "run")
    (gen,) = [s for s in run.spans if s.name == "generate"]
    ends = sorted(s.end_ns for s in run.spans if s.level == Level.MODEL)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["report", str(tmp_path / "run"), "--format", "json"]) == 0
    report = json.loads(buf.getvalue())
    (entry,) = report["generate"]
    assert entry["model_calls"] == 6 and entry["new_tokens"] == 6
    assert entry["ttft_ns"] == ends[0] - gen.start_ns  # to the end of the prefill call
    assert entry["tpot_median_ns"] == int(statistics.median(b - a for a, b in zip(ends, ends[1:])))
    assert entry["tokens_per_s"] == pytest.approx(6e9 / (gen.end_ns - gen.start_ns))
    (finding,) = [f for f in report["findings"] if f["kind"] == "generate"]
    assert "time to first token" in finding["text"] and "per output token" in finding["text"]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["report", str(tmp_path / "run"), "--format", "md"]) == 0
    row = buf.getvalue().split("### Generation", 1)[1].splitlines()[4]
    assert row.startswith("| GPT2LMHeadModel | 6 |")


def test_generate_outside_a_session_is_transformers_own() -> None:
    generate = transformers.generation.utils.GenerationMixin.__dict__["generate"]
    assert getattr(generate, "__module__", "") == "transformers.generation.utils"

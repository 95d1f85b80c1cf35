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
    assert main(["report", str(tmp_path / "run"), "--html", str(tmp_path / "report.html")]) == 0
    findings = (tmp_path / "report.html").read_text().split("Findings", 1)[1]
    assert "generate (GPT2LMHeadModel) at " in findings and "per output token" in findings


def test_generate_outside_a_session_is_transformers_own() -> None:
    generate = transformers.generation.utils.GenerationMixin.__dict__["generate"]
    assert getattr(generate, "__module__", "") == "transformers.generation.utils"


def _line(marker: str) -> int:
    """The number of this file's line that holds ``marker`` (in a comment)."""
    lines = Path(__file__).read_text().splitlines()
    (number,) = [i for i, text in enumerate(lines, 1) if text.rstrip().endswith(f"# SITE: {marker}")]
    return number


def _complete(model: object, prompts: list[torch.Tensor]) -> list[torch.Tensor]:
    """A pipeline-like helper of the user's: one generate() per prompt."""
    out = []
    with torch.no_grad():
        for prompt in prompts:
            out.append(model.generate(prompt, max_new_tokens=3, do_sample=False, pad_token_id=0))  # type: ignore[attr-defined]  # SITE: loop
    return out


def _report(run: Path, fmt: str) -> str:
    import contextlib
    import io

    from mltrace.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["report", str(run), "--format", fmt, "--width", "400"]) == 0
    return buf.getvalue()


def test_generate_names_the_users_line_in_the_span_and_the_report(tmp_path: Path) -> None:
    model = _gpt2()
    prompts = [torch.randint(0, 500, (1, 4)) for _ in range(2)]
    with mltrace.profile(output=tmp_path / "run", summary=False, level="layer"):
        _complete(model, prompts)
        model.generate(prompts[0], max_new_tokens=2, do_sample=False, pad_token_id=0)  # type: ignore[attr-defined]  # SITE: direct
    run = mltrace.load_run(tmp_path / "run")
    gens = sorted((s for s in run.spans if s.name == "generate"), key=lambda s: s.start_ns)
    loop, direct = _line("loop"), _line("direct")
    assert [s.attrs["code.line.number"] for s in gens] == [loop, loop, direct]  # the innermost user frame
    assert {s.attrs["code.file.path"] for s in gens} == {__file__}
    assert [s.attrs["code.function.name"] for s in gens] == ["_complete", "_complete", gens[2].attrs["code.function.name"]]
    assert gens[2].attrs["code.function.name"].endswith("test_generate_names_the_users_line_in_the_span_and_the_report")
    models = sorted((s for s in run.spans if s.level == Level.MODEL), key=lambda s: s.start_ns)
    assert len(models) == 3 + 3 + 2 and {m.parent_id for m in models} == {g.id for g in gens}
    by_generate = {g.id: (g.attrs["code.file.path"], g.attrs["code.line.number"]) for g in gens}
    for m in models:  # the user's line, as the generate span's, not the decode loop's in transformers
        assert (m.attrs["code.file.path"], m.attrs["code.line.number"]) == by_generate[m.parent_id]
        assert (m.attrs["ml.call.file.path"], m.attrs["ml.call.line.number"]) == by_generate[m.parent_id]
    from mltrace.analysis.codepaths import location

    name = Path(__file__).name
    text = _report(tmp_path / "run", "text")
    findings = [line for line in text.splitlines() if "generate (GPT2LMHeadModel)" in line]
    assert [f"{name}:{loop}:" in f for f in findings] == [True, True, False] and f"{name}:{direct}:" in findings[2]
    assert f"generate at {location(__file__, loop)} " in text  # the requests table, its path as the report shortens it
    data = json.loads(_report(tmp_path / "run", "json"))
    assert [m["source"] for m in data["models"]] == [f"{__file__}:{loop}"]  # the most frequent of the model's call sites
    assert [g["source"] for g in data["generate"]] == [f"{__file__}:{loop}"] * 2 + [f"{__file__}:{direct}"]
    assert data["generate"][0]["source_text"].startswith("out.append(model.generate(prompt, max_new_tokens=3")
    assert {r["source"] for r in data["requests"]["slowest"]} <= {f"{__file__}:{loop}", f"{__file__}:{direct}"}
    md = _report(tmp_path / "run", "md").split("### Generation", 1)[1]
    assert f"{name}:{loop}` `out.append(model.generate(prompt" in md


def test_a_pipelines_generate_names_the_line_that_called_the_pipeline(tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {f"w{i}": i for i in range(500)}
    words = tokenizers.Tokenizer(tokenizers.models.WordLevel({**vocab, "[UNK]": 500}, unk_token="[UNK]"))
    words.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]", pad_token="w0")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=501, n_positions=64)).eval()
    pipe = transformers.pipeline("text-generation", model=model, tokenizer=tokenizer, device="cpu")
    with mltrace.profile(output=tmp_path / "run", summary=False, level="model"):
        pipe("w1 w2 w3", max_new_tokens=2, do_sample=False)  # SITE: pipeline
    run = mltrace.load_run(tmp_path / "run")
    (gen,) = [s for s in run.spans if s.name == "generate"]  # called by transformers' text_generation.py
    assert (gen.attrs["code.file.path"], gen.attrs["code.line.number"]) == (__file__, _line("pipeline"))


def test_an_encoder_decoders_encoder_call_is_no_token_step(tmp_path: Path) -> None:
    torch.manual_seed(0)
    shape = {"vocab_size": 300, "d_model": 32, "d_kv": 8, "d_ff": 64, "num_layers": 1, "num_heads": 2}
    config = transformers.T5Config(**shape, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    model = transformers.T5ForConditionalGeneration(config).eval()
    with mltrace.profile(output=tmp_path / "run", summary=False, level="model"), torch.no_grad():
        model.generate(torch.randint(2, 300, (1, 7)), max_new_tokens=5, min_new_tokens=5, do_sample=False)
    run = mltrace.load_run(tmp_path / "run")
    (gen,) = [s for s in run.spans if s.name == "generate"]
    steps = sorted((s for s in run.spans if s.level == Level.MODEL), key=lambda s: s.start_ns)
    assert [s.attrs["ml.generate.phase"] for s in steps] == ["encode", "prefill"] + ["decode"] * 4
    assert steps[0].attrs["ml.layer.type"] == "T5Stack" and gen.attrs["ml.generate.model_calls"] == 6
    (entry,) = json.loads(_report(tmp_path / "run", "json"))["generate"]
    assert entry["model_calls"] == 6 and entry["new_tokens"] == 5
    assert entry["ttft_ns"] == steps[1].end_ns - gen.start_ns  # the first token comes from the decoder's prefill
    tpot = sorted(b.end_ns - a.end_ns for a, b in zip(steps[1:], steps[2:]))
    assert entry["tpot_median_ns"] == int((tpot[1] + tpot[2]) / 2)  # the 4 decode steps, not the encoder's end


def test_a_generate_calls_cold_model_calls_are_counted_beside_its_times(tmp_path: Path) -> None:
    from mltrace.analysis.generation import generate_calls

    model = _gpt2()
    with mltrace.profile(output=tmp_path / "run", summary=False, level="model"), torch.no_grad():
        for _ in range(2):
            _generate(model, torch.randint(0, 500, (1, 4)), 4)
    run = mltrace.load_run(tmp_path / "run")
    steps = sorted((s for s in run.spans if s.level == Level.MODEL), key=lambda s: s.start_ns)
    cold = [(s.start_ns, s.end_ns, s.name) for s in (steps[0], steps[1], steps[4])]  # 2 in the first call, 1 in the second
    first, second = generate_calls(run, cold)
    assert (first.cold_calls, second.cold_calls) == (2, 1)
    assert first.cold_ns == sum(s.end_ns - s.start_ns for s in steps[:2]) and second.cold_ns == steps[4].end_ns - steps[4].start_ns
    assert "2 of its model calls cold (" in first.text() and first.as_dict()["cold_calls"] == 2
    assert generate_calls(run)[0].cold_calls == 0 and "cold" not in generate_calls(run)[0].text()
    entries = json.loads(_report(tmp_path / "run", "json"))["generate"]
    found = generate_calls(run, _cold(tmp_path / "run"))
    assert [(e["cold_calls"], e["cold_ns"]) for e in entries] == [(c.cold_calls, c.cold_ns) for c in found]


def _cold(path: Path) -> list[tuple[int, int, str]]:
    from mltrace.analysis.coldstart import find_cold_start

    return find_cold_start(mltrace.load_run(path)).intervals

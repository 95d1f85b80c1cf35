"""The settings module declares every ``MLTRACE_*`` variable; the options, the code and the docs
take them from it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mltrace import settings
from mltrace.config import ProfileOptions
from mltrace.run.levels import Level

ROOT = Path(__file__).resolve().parent.parent
NAME = re.compile(r"\bMLTRACE_[A-Z][A-Z0-9_]*\b")

#: Per option: a variable's text and the option it gives; an argument and the option it gives.
CASES = {
    "output": ("runs/r1", Path("runs/r1"), "runs/r2", Path("runs/r2")),
    "level": ("op", Level.OP, "layer", Level.LAYER),
    "name": ("infer", "infer", "other", "other"),
    "otlp": ("http://collector:4318", "http://collector:4318", "http://other:4317", "http://other:4317"),
    "flush_interval_s": ("0.25", 0.25, 2, 2.0),
    "op_inferences": ("3", 3, 7, 7),
    "max_spans": ("1000", 1000, 0, 0),
    "op_memory_gib": ("2.5", 2.5, 7, 7.0),
    "stream_perfetto": ("1", True, False, False),
    "memory": ("yes", True, False, False),
    "redact": ("0", False, True, True),
}


def test_every_name_in_the_code_is_declared() -> None:
    declared = {s.name for s in settings.SETTINGS}
    used: dict[str, list[str]] = {}
    for path in sorted((ROOT / "src" / "mltrace").rglob("*")):
        if path.suffix in (".py", ".c", ".pyi"):
            for name in NAME.findall(path.read_text(encoding="utf-8")):
                used.setdefault(name, []).append(str(path.relative_to(ROOT)))
    assert {name: paths for name, paths in used.items() if name not in declared} == {}


def test_names_are_unique_and_options_exist() -> None:
    names = [s.name for s in settings.SETTINGS]
    assert len(names) == len(set(names))
    fields = set(ProfileOptions.__dataclass_fields__)
    assert {s.option for s in settings.PROFILE_SETTINGS} == set(CASES) <= fields


def test_conventions_table_is_the_settings_table() -> None:
    text = (ROOT / "docs" / "CONVENTIONS.md").read_text(encoding="utf-8")
    start = text.index("| variable | value | default |")
    end = text.find("\n\n", start)
    assert text[start : end + 1 if end >= 0 else None] == settings.markdown_table()


@pytest.mark.parametrize("setting", settings.PROFILE_SETTINGS, ids=lambda s: s.name)
def test_each_variable_sets_its_option_and_an_argument_wins(setting: settings.Setting, monkeypatch: pytest.MonkeyPatch) -> None:
    assert setting.option is not None
    text, from_text, argument, from_argument = CASES[setting.option]
    monkeypatch.setenv(setting.name, text)
    assert getattr(ProfileOptions.build(), setting.option) == from_text
    assert getattr(ProfileOptions.build(**{setting.option: argument}), setting.option) == from_argument


def test_an_empty_variable_is_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(settings.NAME.name, "")
    assert settings.NAME.get() is None
    assert ProfileOptions.build().name is None

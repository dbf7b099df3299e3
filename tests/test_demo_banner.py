"""The dashboard says a generated model's text is meaningless: the engine's INFO `generated=1`
(a GGUF written by strata_desk/testmodel.py) puts a note in the banner."""

from __future__ import annotations

from test_tui_layout import shown

from engine.__main__ import GENERATED_KEY
from engine.gguf_file import GGUFFile
from tui import preview
from tui.view import GENERATED_NOTE, model_note


def generated(flag: int):
    snapshot = preview.idle()
    snapshot.engine.info["generated"] = flag
    return snapshot


def test_the_test_models_carry_the_generated_key(tiny_model):
    assert GENERATED_KEY in GGUFFile(tiny_model).metadata


def test_note_only_for_a_generated_model():
    assert model_note(generated(1)) == GENERATED_NOTE
    assert model_note(generated(0)) is None
    assert model_note(preview.idle()) is None  # an engine that does not say
    assert model_note(None) is None


async def test_the_banner_shows_the_note():
    _, lines = await shown(generated(1), (160, 40))
    assert any("A generated test model: its weights are random, so its text is meaningless" in line for line in lines)

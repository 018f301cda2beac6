"""A model's settings in QSettings: one SamplingParams in memory, the flat keys the app has always saved on disk."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

from stowage.app.model_settings import (DEFAULT_SAMPLING, ModelSettings, load_model_settings, open_settings,
                                        save_model_settings)

MODEL = SimpleNamespace(settings_group="models/old-model")  # a group of its own, as a server's model has


def write_file(text: str) -> None:
    path = open_settings().fileName()
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def test_a_file_saved_with_flat_sampling_keys_loads_into_the_sampling_record():
    write_file("[models]\n"
               "old-model\\context_tokens=2048\n"
               "old-model\\temperature=0.3\n"
               "old-model\\top_p=0.8\n"
               "old-model\\top_k=7\n"
               "old-model\\min_p=0.1\n"
               "old-model\\repetition_penalty=1.2\n"
               "old-model\\max_tokens=64\n"
               "old-model\\seed=42\n"
               "old-model\\system_prompt=Be brief.\n")
    s = load_model_settings(open_settings(), MODEL, ModelSettings())
    assert s.sampling == replace(DEFAULT_SAMPLING, temperature=0.3, top_p=0.8, top_k=7, min_p=0.1,
                                 repetition_penalty=1.2, max_tokens=64, seed=42)
    assert (s.context_tokens, s.system_prompt) == (2048, "Be brief.")


def test_values_that_cannot_be_read_or_that_the_engine_refuses_are_the_defaults():
    write_file("[models]\n"
               "old-model\\temperature=-1\n"  # the engine's SamplingParams refuses it
               "old-model\\top_k=lots\n"  # not a number
               "old-model\\seed=\n"  # not set
               "old-model\\max_tokens=64\n")
    s = load_model_settings(open_settings(), MODEL, ModelSettings())
    assert s.sampling == replace(DEFAULT_SAMPLING, max_tokens=64)


def test_saved_settings_keep_the_flat_keys_and_load_the_same():
    chosen = replace(ModelSettings(), context_tokens=1024,
                     sampling=replace(DEFAULT_SAMPLING, temperature=0.0, top_k=0, seed=3))
    settings = open_settings()
    save_model_settings(settings, MODEL, chosen)
    settings.beginGroup(MODEL.settings_group)
    assert {"temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens", "seed"} <= \
        set(settings.childKeys())
    assert "sampling" not in settings.childKeys() and "stop" not in settings.childKeys()
    settings.endGroup()
    settings.sync()
    assert load_model_settings(open_settings(), MODEL, ModelSettings()) == chosen

"""A chat's system prompt and preset (a system prompt with sampling, saved by name and chosen per chat): kept in the
store, shown in the bar above the chat, and what the chat's replies are sent with."""

from __future__ import annotations

from dataclasses import replace

from stowage.engine.errors import InvalidArgumentError
from stowage.engine.runtime.sampler import SamplingParams

from .model_settings import SAMPLING_FIELDS, ModelSettings
from .store import ConversationRow, ConversationStore
from .system_prompt_bar import SystemPromptBar


class ChatPresets:
    """The model of the SystemPromptBar it takes: which preset the chat on screen follows, over the settings."""

    def __init__(self, store: ConversationStore, bar: SystemPromptBar):
        self.store, self.bar = store, bar
        self.settings = ModelSettings()  # the settings panel's: the default system prompt and sampling
        self.presets = store.presets()  # kept here: the settings may change after the store is closed
        self.preset = None  # the chat's (store.Preset), or None

    def show(self, row: ConversationRow | None) -> None:
        """The bar for the chat of `row` (None: no chat yet)."""
        self.preset = self.store.preset(row.preset_id) if row is not None and row.preset_id is not None else None
        self.refresh(row.system_prompt if row is not None else None)

    def refresh(self, own: str | None) -> None:
        """The bar: the chat's own prompt, else its preset's, else the settings' default; and its preset."""
        preset = self.preset
        if preset is None:
            self.bar.show_prompt(own, self.settings.system_prompt)
        else:
            self.bar.show_prompt(own, preset.system_prompt, f"preset “{preset.name}”")
        self.bar.set_presets(self.presets, preset.id if preset else None)

    def choose(self, conversation_id: int, preset_id: int | None) -> None:
        """The chat follows the preset: its system prompt (unless the chat has its own) and its sampling."""
        self.store.set_preset(conversation_id, preset_id)
        self.preset = self.store.preset(preset_id) if preset_id is not None else None
        self.refresh(self.store.conversation(conversation_id).system_prompt)

    def save(self, conversation_id: int, name: str) -> int:
        """The chat's system prompt and sampling saved under `name`, and chosen for the chat from now on."""
        sampling = self.sampling()
        preset_id = self.store.save_preset(name, self.bar.prompt,
                                           {f: getattr(sampling, f) for f in SAMPLING_FIELDS if f != "seed"})
        self.presets = self.store.presets()
        self.choose(conversation_id, preset_id)
        return preset_id

    def delete(self, preset_id: int) -> None:
        self.store.delete_preset(preset_id)
        self.presets = self.store.presets()
        if self.preset is not None and self.preset.id == preset_id:
            self.preset = None
        self.refresh(self.bar.own)

    def sampling(self) -> SamplingParams:
        """The sampling the chat's replies use: the settings', with its preset's values over them."""
        if self.preset is None:
            return self.settings.sampling
        try:
            return replace(self.settings.sampling,
                           **{k: v for k, v in self.preset.sampling.items() if k in SAMPLING_FIELDS})
        except (InvalidArgumentError, TypeError):  # a value the engine refuses (an edited file): the settings'
            return self.settings.sampling

"""The app's File ▸ Get models… dialog against tests/support/hub_server.py, for the screenshot in docs/gui.md (run
under Xvfb by ../shared/tools/screenshot; needs the dev extra: gguf).

Usage: STOWAGE_DATA_DIR=$(mktemp -d) python docs/screenshots/hub.py
The repository holds three real-shape GGUF files of a 1B Llama (16 layers, 128k-token vocabulary) whose tensor data
is a hole (tests/support/gguf_factory.py write_sparse_gguf): the verdicts are this machine's plans of real headers,
read by range requests; nothing is downloaded.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from shots import open_window, when

from gguf_factory import write_sparse_gguf  # noqa: E402 (tests/support, which shots puts on the path)
from hub_server import HubServer, Repo  # noqa: E402

LLAMA_1B = {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
            "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 131072,
            "rope_theta": 500000.0, "rms_norm_eps": 1e-5}
QUANTS = {"Q4_K_M": "q4_k", "Q6_K": "q6_k", "Q8_0": "q8_0"}


def main() -> None:
    folder = Path(tempfile.mkdtemp(prefix="stowage-hub-shot-"))
    files = {}
    for quant, qtype in QUANTS.items():
        path = folder / f"Llama-1B-Instruct-{quant}.gguf"
        write_sparse_gguf(path, LLAMA_1B, {"output.weight": "q6_k"} if qtype == "q4_k" else {}, default=qtype)
        files[path.name] = path
    server = HubServer().__enter__()
    server.add(Repo("example/Llama-1B-Instruct-GGUF", files, tags=("gguf", "llama", "text-generation"),
                    gguf_architecture="llama", downloads=41230, likes=310))
    server.add(Repo("example/Llama-1B-Instruct", {"README.md": b"# weights elsewhere\n"},
                    tags=("safetensors", "llama"), model_type="llama", downloads=90210, likes=1200))
    for repo in server.repos.values():  # their hashes, before anyone asks
        for name in repo.files:
            server.blob(repo, name)
    os.environ["HF_ENDPOINT"] = server.url
    os.environ["HF_HUB_CACHE"] = str(folder / "hf-cache")

    app, window = open_window()

    def open_dialog():
        window.get_models_action.trigger()
        dialog = window.hub_dialog
        dialog.move(120, 80)
        dialog.search_box.setText("llama-1b")
        dialog.search()
        when(lambda: dialog.results.count() > 0, lambda: pick(dialog))

    def pick(dialog):
        dialog.context.setValue(32768)
        dialog.results.setCurrentRow(1)  # the GGUF repository (the safetensors one is more downloaded)
        when(lambda: len(dialog.verdicts) == len(QUANTS), lambda: dialog.table.selectRow(0))

    when(lambda: window.settings_panel.plan is not None, open_dialog)
    sys.exit(app.exec())


if __name__ == "__main__":
    main()

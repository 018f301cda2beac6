"""Shared pieces of the CPU benchmarks: real-shaped models with random weights, memory probes, fresh-process runs."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# SmolLM2-360M's shape (its config.json), with random weights: speed depends on the shape only.
SMOLLM2_360M = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 960,
    "intermediate_size": 2560,
    "num_hidden_layers": 32,
    "num_attention_heads": 15,
    "num_key_value_heads": 5,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
    "max_position_embeddings": 8192,
    "rope_theta": 100000.0,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "bfloat16",
    "initializer_range": 0.02,
}
# SmolLM2-135M's and SmolLM2-1.7B's shapes: the small model people run, and one of the largest a laptop decodes.
SMOLLM2_135M = SMOLLM2_360M | {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                               "num_attention_heads": 9, "num_key_value_heads": 3,
                               "max_position_embeddings": 32768}  # room for the long-context decode case
SMOLLM2_1_7B = SMOLLM2_360M | {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 24,
                               "num_attention_heads": 32, "num_key_value_heads": 32, "tie_word_embeddings": True}
SHAPES = {"135m": SMOLLM2_135M, "360m": SMOLLM2_360M, "1.7b": SMOLLM2_1_7B}
BUILD_VERSION = 1  # bump when the files written below change, so cached copies are rebuilt
GGUF_VERSION = 2


def build_model(workdir: Path, *, seed: int = 0, shape: str = "360m") -> Path:
    """Write the model folder of SHAPES[shape] once (config.json, model.safetensors, tokenizer files); reuse it after."""
    workdir.mkdir(parents=True, exist_ok=True)
    model_dir = workdir / f"smollm2-{shape}-shape"
    stamp = model_dir / ".complete"
    c = SHAPES[shape]
    want = json.dumps({"version": BUILD_VERSION, "config": c, "seed": seed}, sort_keys=True)
    if stamp.exists() and stamp.read_text() == want:
        return model_dir
    import torch
    from safetensors.torch import save_file
    sys.path.insert(0, str(ROOT / "tests" / "support"))
    from factory import save_tokenizer

    started = time.perf_counter()
    print(f"building {model_dir} (random bf16 weights, std 0.02) ...", file=sys.stderr, flush=True)
    tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=workdir))
    hidden, inter = c["hidden_size"], c["intermediate_size"]
    head_dim = hidden // c["num_attention_heads"]
    kv = c["num_key_value_heads"] * head_dim
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)

    tensors = {"model.embed_tokens.weight": randn(c["vocab_size"], hidden),
               "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
            p + "self_attn.q_proj.weight": randn(hidden, hidden),
            p + "self_attn.k_proj.weight": randn(kv, hidden),
            p + "self_attn.v_proj.weight": randn(kv, hidden),
            p + "self_attn.o_proj.weight": randn(hidden, hidden),
            p + "mlp.gate_proj.weight": randn(inter, hidden),
            p + "mlp.up_proj.weight": randn(inter, hidden),
            p + "mlp.down_proj.weight": randn(hidden, inter),
        }
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(c, indent=2))
    (tmp / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": c["bos_token_id"], "eos_token_id": c["eos_token_id"]}))
    save_tokenizer(tmp)
    if model_dir.exists():
        shutil.rmtree(model_dir)
    tmp.rename(model_dir)
    stamp.write_text(want)
    print(f"built in {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
    return model_dir


def weight_bytes(model_dir: Path) -> int:
    """Bytes of every stored tensor: what one decode step reads (tied lm_head is stored once)."""
    from safetensors import safe_open

    total = 0
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), "np") as f:
            for name in f.keys():
                s = f.get_slice(name)
                n = 1
                for d in s.get_shape():
                    n *= d
                total += n * {"BF16": 2, "F16": 2, "F32": 4}[s.get_dtype()]
    return total


# -- conversion to GGUF for llama.cpp -----------------------------------------------------------
def convert_gguf(model_dir: Path) -> Path:
    """The same weights as a bf16 GGUF (llama.cpp's layout: Q/K rows permuted, as convert_hf_to_gguf does)."""
    import gguf
    import numpy as np
    import torch
    from safetensors import safe_open

    path = model_dir.parent / f"{model_dir.name}.bf16.gguf"
    stamp = path.with_suffix(".complete")
    want = f"gguf {GGUF_VERSION} " + (model_dir / ".complete").read_text()
    if path.exists() and stamp.exists() and stamp.read_text() == want:
        return path
    print(f"converting to {path} ...", file=sys.stderr, flush=True)
    c = json.loads((model_dir / "config.json").read_text())
    heads, kv_heads = c["num_attention_heads"], c["num_key_value_heads"]
    tmp = path.with_name(path.name + ".partial")
    w = gguf.GGUFWriter(str(tmp), "llama")
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_block_count(c["num_hidden_layers"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(c["hidden_size"] // heads)
    w.add_rope_freq_base(c["rope_theta"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_vocab_size(c["vocab_size"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_BF16)
    # A byte-level BPE vocab of the right size; the benchmark feeds token ids, so its contents do not matter.
    alphabet = [chr(b) if 33 <= b <= 126 else chr(256 + b) for b in range(256)]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(alphabet + ["ab"] + [f"<t{i}>" for i in range(c["vocab_size"] - 257)])
    w.add_token_types([gguf.TokenType.NORMAL] * c["vocab_size"])
    w.add_token_merges(["a b"])  # llama.cpp refuses a BPE vocab without merges
    w.add_bos_token_id(c["bos_token_id"])
    w.add_eos_token_id(c["eos_token_id"])

    def permute(x, n_head):
        return x.reshape(n_head, 2, x.shape[0] // n_head // 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)

    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        for name in f.keys():
            x = f.get_tensor(name).view(torch.int16).numpy().view(np.uint16)
            if name == "model.embed_tokens.weight":
                out = "token_embd.weight"
            elif name == "model.norm.weight":
                out = "output_norm.weight"
            else:
                _, _, i, rest = name.split(".", 3)
                out = f"blk.{i}.{names[rest.removesuffix('.weight')]}.weight"
                if rest.startswith("self_attn.q_proj"):
                    x = permute(x, heads)
                elif rest.startswith("self_attn.k_proj"):
                    x = permute(x, kv_heads)
            if out.endswith("norm.weight"):  # llama.cpp wants norms in fp32
                x = (x.astype(np.uint32) << 16).view(np.float32)
                w.add_tensor(out, x)
            else:
                w.add_tensor(out, np.ascontiguousarray(x), raw_dtype=gguf.GGMLQuantizationType.BF16)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.rename(path)
    stamp.write_text(want)
    return path


# -- measuring inside a worker ------------------------------------------------------------------
def peak_rss_bytes() -> int:
    """This process's peak resident set (VmHWM: unlike ru_maxrss it does not carry the parent's over exec)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def anonymous_bytes() -> int:
    from memory import anonymous_bytes as anon

    return anon()


def set_threads(threads: int) -> None:
    """torch's threads and the native decode step's (kernels/cpu_decode.py: its own pool, not torch's)."""
    import torch

    os.environ["STOWAGE_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    torch.set_num_interop_threads(1)
    from stowage.kernels import cpu_decode

    cpu_decode.set_threads(threads)


# -- orchestrating ------------------------------------------------------------------------------
def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def source_state(packages=("engine", "kernels")) -> tuple[str, str]:
    """(digest of the engine's source files, 'commit' or 'commit + uncommitted changes'): the run's engine version."""
    import hashlib

    digest = hashlib.sha1()
    for package in packages:
        for path in sorted((ROOT / package).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix not in (".so", ".o", ".pyc"):
                digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
    git = ["git", "-C", str(ROOT)]
    try:
        commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run([*git, "status", "--porcelain", "--", *packages], capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return digest.hexdigest()[:12], "unknown commit"
    return digest.hexdigest()[:12], commit + (f" + uncommitted changes in {', '.join(p + '/' for p in packages)}" if dirty else "")


def run_worker(script: Path, args: list[str], *, threads: int, timeout: float = 900) -> dict:
    """Run `script --worker ...` in a fresh interpreter; return the JSON it writes."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = Path(f.name)
    env = os.environ | {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
                        "TOKENIZERS_PARALLELISM": "false", "PYTHONWARNINGS": "ignore",
                        "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_OFFLINE": "1"}
    try:
        proc = subprocess.run([sys.executable, str(script), *args, "--result", str(out)], env=env,
                              timeout=timeout, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"worker {args} failed ({proc.returncode}):\n{proc.stdout[-4000:]}")
        return json.loads(out.read_text())
    finally:
        out.unlink(missing_ok=True)


def medians(runs: list[dict]) -> dict:
    """Per key, the median over runs of the numbers (other values from the first run)."""
    keys = {k for r in runs for k in r}
    result = {}
    for k in keys:
        values = [r[k] for r in runs if k in r]
        numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
        result[k] = statistics.median(values) if numeric else values[0]
    return result


def write_section(doc: Path, heading: str, body: str) -> None:
    """Replace (or add) the `## heading` section of doc, leaving the other sections alone."""
    text = doc.read_text() if doc.exists() else "# Benchmarks\n\nEach section is written by its own script; re-run it to refresh.\n"
    lines = text.splitlines()
    start = next((i for i, l in enumerate(lines) if l.strip() == heading), None)
    new = [heading, "", *body.rstrip().splitlines(), ""]
    if start is None:
        lines = [*lines, "", *new] if lines and lines[-1] else [*lines, *new]
    else:
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
        lines = lines[:start] + new + lines[end:]
    doc.write_text("\n".join(lines).rstrip() + "\n")

"""A tiny random-weight LLaVA-style vision projector, written with the ``gguf`` package.

koboldcpp loads a vision projector with ``--mmproj <file.gguf>`` (its
``tools/mtmd/clip.cpp``, from llama.cpp) and then reports ``"vision": true``
and decodes image parts of chat requests. This writes the smallest projector
of the LLaVA-1.5 layout (``clip.projector_type`` "mlp") that it loads:

- a vision tower of one transformer block, ``width`` wide (``v.*``): patch
  embedding (a ``patch_size`` convolution), class and position embeddings,
  the pre-layer norm, and the block's attention, norms and feed-forward;
- the two-layer projector ``mm.0`` (``width`` to ``hidden``) and ``mm.2``
  (``hidden`` to ``text_embd``), whose output width must be the text model's
  embedding width (576 for SmolLM2-135M), which koboldcpp checks.

The weights are random (a fixed seed), so the model "sees" noise; what the
tests check is that the whole image path is real: the worker's data URL reaches
koboldcpp, which decodes it (``image decoded (batch 1/1)`` in its log).

Shapes: ``gguf`` takes numpy arrays in row-major order and stores ggml's
dimensions reversed, so a linear layer from ``n_in`` to ``n_out`` is a
``(n_out, n_in)`` array. The feed-forward is ``ff`` wide, unlike ``width``:
the loader takes a block whose ``ffn_down`` has ``width`` as its first ggml
dimension for an old file with up and down swapped.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def write_tiny_projector(
    path: Path,
    *,
    text_embd: int = 576,
    width: int = 32,
    ff: int = 64,
    hidden: int = 64,
    heads: int = 4,
    image_size: int = 32,
    patch_size: int = 8,
    seed: int = 0,
) -> Path:
    """Write the projector to ``path`` (about 0.2 MB with the defaults, in well under a second) and return it.

    Raises:
        ImportError: the ``gguf`` package (the ``test-gguf`` extra) is missing.
    """
    import gguf
    import numpy as np

    rng = np.random.default_rng(seed)

    def weights(*shape: int) -> Any:
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    def ones(n: int) -> Any:
        return np.ones(n, dtype=np.float32)

    def zeros(n: int) -> Any:
        return np.zeros(n, dtype=np.float32)

    patches = (image_size // patch_size) ** 2
    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_name("koboldcpp-horde-chat test projector (random weights)")
    writer.add_bool("clip.has_text_encoder", False)
    writer.add_bool("clip.has_vision_encoder", True)
    writer.add_bool("clip.has_llava_projector", True)
    writer.add_string("clip.projector_type", "mlp")
    writer.add_bool("clip.use_gelu", True)
    writer.add_uint32("clip.vision.image_size", image_size)
    writer.add_uint32("clip.vision.patch_size", patch_size)
    writer.add_uint32("clip.vision.embedding_length", width)
    writer.add_uint32("clip.vision.feed_forward_length", ff)
    writer.add_uint32("clip.vision.projection_dim", text_embd)
    writer.add_uint32("clip.vision.attention.head_count", heads)
    writer.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-5)
    writer.add_uint32("clip.vision.block_count", 1)
    writer.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    writer.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])

    tensors = {
        "v.class_embd": weights(width),
        "v.patch_embd.weight": weights(width, 3, patch_size, patch_size),
        "v.position_embd.weight": weights(patches + 1, width),
        "v.pre_ln.weight": ones(width),
        "v.pre_ln.bias": zeros(width),
        "v.blk.0.ln1.weight": ones(width),
        "v.blk.0.ln1.bias": zeros(width),
        "v.blk.0.ln2.weight": ones(width),
        "v.blk.0.ln2.bias": zeros(width),
        "v.blk.0.ffn_up.weight": weights(ff, width),
        "v.blk.0.ffn_up.bias": zeros(ff),
        "v.blk.0.ffn_down.weight": weights(width, ff),
        "v.blk.0.ffn_down.bias": zeros(width),
        "mm.0.weight": weights(hidden, width),
        "mm.0.bias": zeros(hidden),
        "mm.2.weight": weights(text_embd, hidden),
        "mm.2.bias": zeros(text_embd),
    }
    for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
        tensors[f"v.blk.0.{name}.weight"] = weights(width, width)
        tensors[f"v.blk.0.{name}.bias"] = zeros(width)
    for name, data in tensors.items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path

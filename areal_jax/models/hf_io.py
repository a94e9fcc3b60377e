"""HF checkpoints (config.json + safetensors) to and from the NNX decoder.

Loading reads each tensor straight into its target sharding with `jax.make_array_from_callback`: a
device's shard is cut from the file (through a memory map) and nothing is gathered on one device
first. Exporting writes a directory that `transformers` loads, atomically (temporary name, then rename).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np
from flax import nnx
from flax.typing import PathParts
from jax.experimental import multihost_utils
from jax.sharding import Mesh
from safetensors import safe_open
from safetensors.numpy import save_file

from areal_jax.models.config import ModelConfig
from areal_jax.models.decoder import Decoder
from areal_jax.models.hf_config import CheckpointError, checkpoint_dtype, model_config_from_hf, model_config_to_hf
from areal_jax.models.hybrid import new_decoder
from areal_jax.models.hybrid_io import hybrid_tensor_table, moe_tensor_table, text_model_view
from areal_jax.models.init import fresh_adapters
from areal_jax.models.lora import adapter_free
from areal_jax.progress import Progress
from areal_jax.sharding import state_shardings

logger = logging.getLogger(__name__)

_NUMPY_DTYPES = {
    "float32": np.dtype(np.float32),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float16": np.dtype(np.float16),
}
# Tensors some checkpoints carry that the model derives or does not use.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


# -- parameter name and layout mapping ----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TensorMapping:
    """How one of our parameters is stored in HF: the tensor names it is made of (with `{i}` for the
    layer; a fused kernel has several), and the layout conversions: `to_ours(hf_tensors) -> ours`,
    `to_hf(ours) -> hf_tensors`, in the order of `hf_names`."""

    hf_names: tuple[str, ...]
    to_ours: Callable[[list[np.ndarray]], np.ndarray]
    to_hf: Callable[[np.ndarray], list[np.ndarray]]
    per_layer: bool
    # the layers HF stores it in (None: every layer); ours holds zeros in the others (dense and sparse layers mixed)
    layers: tuple[int, ...] | None = None
    # ours stacks only `layers`, entry e holding layer layers[e] (a `HybridDecoder`'s stack of one layer kind)
    compact: bool = False

    def stored_layers(self, num_layers: int) -> Sequence[int | None]:
        """The layer of each stored copy: [None] when not per layer."""
        if not self.per_layer:
            return [None]
        return range(num_layers) if self.layers is None else self.layers

    def entry(self, layer: int) -> int:
        """Our stack's entry holding HF layer `layer`."""
        return self.layers.index(layer) if self.compact and self.layers is not None else layer

    def layer_of(self, entry: int) -> int:
        """The HF layer our stack's entry `entry` holds."""
        return self.layers[entry] if self.compact and self.layers is not None else entry


def _one(to_ours: Callable[[np.ndarray], np.ndarray], to_hf: Callable[[np.ndarray], np.ndarray]) -> tuple:
    """The conversions of a parameter stored as a single HF tensor."""
    return (lambda ws: to_ours(ws[0]), lambda w: [to_hf(w)])


def tensor_mappings(cfg: ModelConfig) -> dict[PathParts, TensorMapping]:
    """Our state path -> HF tensors, for every parameter of `cfg`'s decoder."""
    if cfg.hybrid is not None:
        return {
            path: TensorMapping(names, fns[0], fns[1], per_layer, layers, compact=True)
            for path, (names, fns, per_layer, layers) in hybrid_tensor_table(cfg).items()
        }
    d, n, k, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim
    g = n // k
    layer = "model.layers.{i}."
    attn = layer + "self_attn."
    identity = _one(lambda w: w, lambda w: w)
    transpose = _one(lambda w: w.T, lambda w: w.T)

    def qkv_kernel(ws: list[np.ndarray]) -> np.ndarray:  # HF q [N*H, D], k/v [K*H, D] -> [D, K, G+2, H]
        q, key, value = (w.T.reshape(d, k, -1, h) for w in ws)
        return np.concatenate([q, key, value], axis=2)

    def qkv_kernel_to_hf(w: np.ndarray) -> list[np.ndarray]:
        return [w[:, :, :g].reshape(d, n * h).T, w[:, :, g].reshape(d, k * h).T, w[:, :, g + 1].reshape(d, k * h).T]

    def qkv_bias(bs: list[np.ndarray]) -> np.ndarray:  # HF [N*H], [K*H], [K*H] -> [K, G+2, H]
        return np.concatenate([b.reshape(k, -1, h) for b in bs], axis=1)

    def qkv_bias_to_hf(b: np.ndarray) -> list[np.ndarray]:
        return [b[:, :g].reshape(n * h), b[:, g].reshape(k * h), b[:, g + 1].reshape(k * h)]

    gate_up = (lambda ws: np.stack([w.T for w in ws], axis=1), lambda w: [w[:, 0].T, w[:, 1].T])  # [F, D]x2 <-> [D,2,F]
    o_proj = _one(lambda w: w.T.reshape(n, h, d), lambda w: w.reshape(n * h, d).T)  # HF [D, N*H] <-> [N, H, D]
    qkv_names = (attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight")
    table: dict[tuple[str, ...], tuple[tuple[str, ...], tuple[Callable, Callable], bool]] = {
        ("embed",): (("model.embed_tokens.weight",), identity, False),
        ("final_norm", "weight"): (("model.norm.weight",), identity, False),
        ("layers", "input_norm", "weight"): ((layer + "input_layernorm.weight",), identity, True),
        ("layers", "post_attention_norm", "weight"): ((layer + "post_attention_layernorm.weight",), identity, True),
        ("layers", "qkv", "kernel"): (qkv_names, (qkv_kernel, qkv_kernel_to_hf), True),
        ("layers", "o"): ((attn + "o_proj.weight",), o_proj, True),
        ("layers", "mlp", "gate_up"): ((layer + "mlp.gate_proj.weight", layer + "mlp.up_proj.weight"), gate_up, True),
        ("layers", "mlp", "down"): ((layer + "mlp.down_proj.weight",), transpose, True),
    }
    if cfg.qkv_bias:
        bias_names = tuple(name.replace(".weight", ".bias") for name in qkv_names)
        table[("layers", "qkv", "bias")] = (bias_names, (qkv_bias, qkv_bias_to_hf), True)
    if cfg.qk_norm:
        table[("layers", "qkv", "q_norm", "weight")] = ((attn + "q_norm.weight",), identity, True)
        table[("layers", "qkv", "k_norm", "weight")] = ((attn + "k_norm.weight",), identity, True)
    if not cfg.tie_word_embeddings:
        table[("lm_head",)] = (("lm_head.weight",), transpose, False)
    layers_of: dict[PathParts, tuple[int, ...] | None] = {}
    if cfg.moe is not None:  # the router, the experts and Qwen2-MoE's shared expert with its gate
        for path, (names, fns) in moe_tensor_table(cfg.moe, layer + "mlp.").items():
            table[("layers", "moe", *path)] = (names, fns, True)
        sparse = cfg.sparse_layers
        dense_layers = tuple(i for i, is_sparse in enumerate(sparse) if not is_sparse)
        sparse_layers = tuple(i for i, is_sparse in enumerate(sparse) if is_sparse)
        for path in list(table):
            if path[:2] == ("layers", "mlp"):
                if dense_layers:
                    layers_of[path] = dense_layers if sparse_layers else None
                else:
                    del table[path]
            elif path[:2] == ("layers", "moe"):
                if sparse_layers:
                    layers_of[path] = sparse_layers if dense_layers else None
                else:
                    del table[path]
    return {
        path: TensorMapping(names, fns[0], fns[1], per_layer, layers_of.get(path))
        for path, (names, fns, per_layer) in table.items()
    }


def _hf_names(mapping: TensorMapping, layer: int | None) -> list[str]:
    """The HF names of `mapping`'s tensors for one layer (or, not per layer, `layer` None)."""
    return [name.format(i=layer) if mapping.per_layer else name for name in mapping.hf_names]


# -- reading ------------------------------------------------------------------------------------


class _SafetensorsReader:
    """Name -> tensor access over `model.safetensors` or a sharded index, files opened once; a multimodal
    checkpoint's language model under the names of a text-only one (`hybrid_io.text_model_view`)."""

    def __init__(self, directory: Path, stack: ExitStack):
        index = directory / "model.safetensors.index.json"
        single = directory / "model.safetensors"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.file_of = {name: directory / fname for name, fname in weight_map.items()}
        elif single.exists():
            self.file_of = {}
            with safe_open(str(single), framework="numpy") as handle:
                self.file_of = dict.fromkeys(handle.keys(), single)
        else:
            raise CheckpointError(f"{directory}: neither model.safetensors nor model.safetensors.index.json found")
        view = text_model_view(self.file_of)
        self.file_of = {name: file for name, (_, file) in view.items()}
        self._stored_name = {name: stored for name, (stored, _) in view.items()}
        self._handles: dict[Path, Any] = {}
        self._stack = stack

    def names(self) -> set[str]:
        return set(self.file_of)

    def _handle(self, name: str) -> Any:
        path = self.file_of[name]
        if path not in self._handles:
            if not path.exists():
                raise CheckpointError(f"tensor {name!r}: shard file {path} listed in the index is missing")
            self._handles[path] = self._stack.enter_context(safe_open(str(path), framework="numpy"))
        return self._handles[path]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(self._stored_name[name]).get_shape())

    def read(self, name: str) -> np.ndarray:
        return self._handle(name).get_tensor(self._stored_name[name])


def _expected_hf_shapes(mapping: TensorMapping, our_shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    shape = our_shape[1:] if mapping.per_layer else our_shape
    return [part.shape for part in mapping.to_hf(np.empty(shape, np.int8))]


def _check_tensors(
    reader: _SafetensorsReader,
    mappings: Mapping[PathParts, TensorMapping],
    shapes: Mapping[PathParts, tuple[int, ...]],
    cfg: ModelConfig,
) -> None:
    expected_names: set[str] = set()
    for path, mapping in mappings.items():
        wants = _expected_hf_shapes(mapping, shapes[path])
        for layer in mapping.stored_layers(cfg.num_layers):
            for name, want in zip(_hf_names(mapping, layer), wants, strict=True):
                expected_names.add(name)
                if name not in reader.file_of:
                    raise CheckpointError(f"tensor {name!r} is missing from the checkpoint (expected shape {want})")
                got = reader.shape(name)
                if got != want:
                    raise CheckpointError(f"tensor {name!r} has shape {got}, expected {want} from config.json")
    extra = sorted(n for n in reader.names() - expected_names if not n.endswith(_IGNORED_SUFFIXES))
    if extra:
        logger.warning("ignoring %d checkpoint tensors the model does not use: %s", len(extra), extra[:8])


def _array_from_file(
    reader: _SafetensorsReader,
    mapping: TensorMapping,
    shape: tuple[int, ...],
    dtype: np.dtype,
    sharding: jax.sharding.Sharding,
    num_layers: int,
) -> jax.Array:
    """Build one parameter directly in `sharding`: every shard is cut from the file it needs."""

    def layer_tensor(i: int | None) -> np.ndarray:
        return mapping.to_ours([reader.read(name) for name in _hf_names(mapping, i)]).astype(dtype, copy=False)

    stored = set(mapping.stored_layers(num_layers))

    def shard(index: tuple[slice, ...]) -> np.ndarray:
        if not mapping.per_layer:
            return np.ascontiguousarray(layer_tensor(None)[index])
        layers = [mapping.layer_of(e) for e in range(*index[0].indices(shape[0]))]
        zeros = np.zeros(shape[1:], dtype)  # a layer HF does not store this in (dense and sparse layers mixed)
        return np.stack([(layer_tensor(i) if i in stored else zeros)[index[1:]] for i in layers], axis=0)

    # jax annotates the callback's index `Index | None` but asserts it is not None before calling back
    return jax.make_array_from_callback(shape, sharding, shard)  # type: ignore[arg-type]


def load_hf_checkpoint(
    directory: str | Path, mesh: Mesh | None = None, config: ModelConfig | None = None, **config_overrides: Any
) -> tuple[ModelConfig, Decoder]:
    """Load an HF Qwen2/Qwen3/Llama/Qwen3-MoE directory into a `Decoder`, each tensor read in its stored dtype and
    placed in `param_dtype` on its sharding under `mesh` (or on the default device). The model's config is
    `config` when given (made from this checkpoint's config.json), else config.json with `config_overrides`
    setting ModelConfig fields."""
    directory = Path(directory)
    config_file = directory / "config.json"
    if not config_file.exists():
        raise CheckpointError(f"{config_file} not found")
    hf = json.loads(config_file.read_text())
    cfg = config or model_config_from_hf(hf, **config_overrides)
    abstract = nnx.eval_shape(lambda: new_decoder(cfg, nnx.Rngs(0)))
    graphdef, abstract_state = nnx.split(abstract)
    if mesh is not None:
        shardings = state_shardings(abstract_state, mesh)
    else:
        replicated = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        shardings = jax.tree.map(
            lambda v: v.replace(replicated), abstract_state, is_leaf=lambda x: isinstance(x, nnx.Variable)
        )
    mappings = tensor_mappings(cfg)
    # LoRA adapters are not in an HF checkpoint: they start fresh (`peft_io` loads trained ones)
    flat_abstract = dict(nnx.to_flat_state(adapter_free(abstract_state)))
    flat_shardings = dict(nnx.to_flat_state(shardings))
    unmapped = set(flat_abstract) - set(mappings)
    if unmapped:
        raise CheckpointError(f"no HF mapping for parameters {sorted(unmapped)}")
    dtype = _NUMPY_DTYPES[cfg.param_dtype]
    progress = Progress(f"loading HF checkpoint {directory}: parameters", len(flat_abstract), log=logger)
    with ExitStack() as stack:
        reader = _SafetensorsReader(directory, stack)
        shapes = {path: tuple(var.get_value().shape) for path, var in flat_abstract.items()}
        _check_tensors(reader, mappings, shapes, cfg)
        loaded = {}
        for path, var in flat_abstract.items():
            array = _array_from_file(
                reader, mappings[path], shapes[path], dtype, flat_shardings[path].get_value(), cfg.num_layers
            )
            loaded[path] = var.replace(array)
            progress.advance("/".join(map(str, path)))
    state = nnx.from_flat_state(loaded)
    if cfg.lora is not None:
        state = nnx.merge_state(state, fresh_adapters(cfg, shardings))
    nbytes = sum(v.get_value().nbytes for v in loaded.values())
    progress.done(
        f"{cfg.num_params() / 1e6:.0f}M parameters stored as {checkpoint_dtype(hf)}, held as "
        f"{cfg.param_dtype} ({nbytes / 2**30:.2f} GiB)"
    )
    return cfg, nnx.merge(graphdef, state)


# -- writing ------------------------------------------------------------------------------------


def _to_host(x: jax.Array) -> np.ndarray:
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))


def iter_hf_tensors(cfg: ModelConfig, model: Decoder) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, array) for every tensor of `model`, in HF layout and `cfg`'s export dtype (rounded to
    nearest), one parameter on the host at a time."""
    if cfg.lora is not None:
        raise ValueError(
            "an HF checkpoint holds no LoRA adapters: export them with peft_io.save_peft_adapter, or merge them "
            "first (lora.merged_state) into the decoder without lora"
        )
    flat_state = dict(nnx.to_flat_state(nnx.state(model)))
    dtype = _NUMPY_DTYPES[cfg.resolved_export_dtype]
    for path, mapping in tensor_mappings(cfg).items():
        value = _to_host(flat_state[path].get_value()).astype(dtype, copy=False)
        for layer in mapping.stored_layers(cfg.num_layers):
            parts = mapping.to_hf(value if layer is None else value[mapping.entry(layer)])
            for name, part in zip(_hf_names(mapping, layer), parts, strict=True):
                yield name, np.ascontiguousarray(part)


TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
)


def save_hf_checkpoint(
    cfg: ModelConfig,
    model: Decoder,
    directory: str | Path,
    max_shard_bytes: int = 2 * 1024**3,
    tokenizer_dir: str | Path | None = None,
) -> Path:
    """Write `config.json` and safetensors (sharded with an index past `max_shard_bytes`) that
    `transformers` loads, plus the tokenizer files (`TOKENIZER_FILES`) found in `tokenizer_dir`, so the
    directory is a complete checkpoint. Written under a temporary name and renamed, so a crash leaves no
    partial directory at `directory`. In multi-process runs every process gathers; process 0 writes."""
    directory = Path(directory)
    writer = jax.process_index() == 0
    tmp = directory.with_name(f".{directory.name}.tmp-{os.getpid()}")
    if writer:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    shard_names: list[list[str]] = []
    pending: dict[str, np.ndarray] = {}
    pending_bytes = total_bytes = 0

    def flush() -> None:
        nonlocal pending, pending_bytes
        if writer:
            save_file(pending, str(tmp / f"part-{len(shard_names):05d}.safetensors"), metadata={"format": "pt"})
        shard_names.append(list(pending))
        pending, pending_bytes = {}, 0

    for name, array in iter_hf_tensors(cfg, model):
        if pending and pending_bytes + array.nbytes > max_shard_bytes:
            flush()
        pending[name] = array
        pending_bytes += array.nbytes
        total_bytes += array.nbytes
    flush()
    if not writer:
        return directory
    if len(shard_names) == 1:
        (tmp / "part-00000.safetensors").rename(tmp / "model.safetensors")
    else:
        weight_map = {}
        for i, names in enumerate(shard_names):
            fname = f"model-{i + 1:05d}-of-{len(shard_names):05d}.safetensors"
            (tmp / f"part-{i:05d}.safetensors").rename(tmp / fname)
            weight_map.update(dict.fromkeys(names, fname))
        index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (tmp / "config.json").write_text(json.dumps(model_config_to_hf(cfg), indent=2))
    if tokenizer_dir is not None:
        for name in TOKENIZER_FILES:
            if (Path(tokenizer_dir) / name).is_file():
                shutil.copyfile(Path(tokenizer_dir) / name, tmp / name)
    directory.parent.mkdir(parents=True, exist_ok=True)
    previous = directory.with_name(f".{directory.name}.old-{os.getpid()}")
    if directory.exists():
        directory.rename(previous)
    tmp.rename(directory)
    if previous.exists():
        shutil.rmtree(previous)
    return directory

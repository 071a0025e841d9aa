"""Wan 2.1 transformer checkpoints in any of three naming schemes, converted and checked.

A Wan 2.1 transformer's weights are published under three module-name schemes (DESIGN.md §4):

============ ======================================== =========================================
scheme       example                                  who writes it
============ ======================================== =========================================
``diffusers`` ``blocks.0.attn1.to_q.weight``          diffusers ``save_pretrained``
``fastvideo`` ``blocks.0.to_q.weight``                FastVideo (the published Attn-QAT weights)
``wan``      ``blocks.0.self_attn.q.weight``          the original Wan release
============ ======================================== =========================================

:func:`detect_scheme` tells them apart from the keys, :func:`to_diffusers` renames a state dict to
diffusers' names (:func:`from_diffusers` is the inverse), and :func:`load_wan_transformer` loads a
diffusers transformer folder or one ``.safetensors`` file into a
:class:`~diffusers.WanTransformer3DModel`, after checking that every tensor has a place in the model,
every parameter of the model is present and every shape matches. Problems are reported by name in one
:class:`CheckpointError`; nothing is ignored silently.

Original Wan names its block norms in the order they run as ``norm1, norm3, norm2``; diffusers uses
``norm1, norm2, norm3``. So Wan's ``norm3`` (the affine norm before cross-attention) is diffusers'
``norm2``, and Wan's ``norm2`` is diffusers' ``norm3`` (which has no parameters).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch

from . import sidecar

SCHEMES = ("diffusers", "fastvideo", "wan")

# Prefixes that training frameworks and single-file exporters put in front of the model's names.
KNOWN_PREFIXES = ("model.diffusion_model.", "diffusion_model.", "module.", "_orig_mod.", "model.",
                  "transformer.", "_fsdp_wrapped_module.")

# Renaming rules as (diffusers name, other scheme's name) templates. ``{n}`` is a block index,
# ``{p}`` the parameter's last name component (``weight``, ``bias``). A name that no rule matches is
# the same in both schemes (e.g. ``proj_out.weight`` in FastVideo, ``patch_embedding.bias`` in Wan).
_FASTVIDEO_NAMES: tuple[tuple[str, str], ...] = (
    ("patch_embedding.{p}", "patch_embedding.proj.{p}"),
    ("condition_embedder.text_embedder.linear_1.{p}", "condition_embedder.text_embedder.fc_in.{p}"),
    ("condition_embedder.text_embedder.linear_2.{p}", "condition_embedder.text_embedder.fc_out.{p}"),
    ("condition_embedder.time_embedder.linear_1.{p}", "condition_embedder.time_embedder.mlp.fc_in.{p}"),
    ("condition_embedder.time_embedder.linear_2.{p}", "condition_embedder.time_embedder.mlp.fc_out.{p}"),
    ("condition_embedder.time_proj.{p}", "condition_embedder.time_modulation.linear.{p}"),
    ("blocks.{n}.attn1.to_q.{p}", "blocks.{n}.to_q.{p}"),
    ("blocks.{n}.attn1.to_k.{p}", "blocks.{n}.to_k.{p}"),
    ("blocks.{n}.attn1.to_v.{p}", "blocks.{n}.to_v.{p}"),
    ("blocks.{n}.attn1.to_out.0.{p}", "blocks.{n}.to_out.{p}"),
    ("blocks.{n}.attn1.norm_q.{p}", "blocks.{n}.norm_q.{p}"),
    ("blocks.{n}.attn1.norm_k.{p}", "blocks.{n}.norm_k.{p}"),
    ("blocks.{n}.attn2.to_out.0.{p}", "blocks.{n}.attn2.to_out.{p}"),
    ("blocks.{n}.ffn.net.0.proj.{p}", "blocks.{n}.ffn.fc_in.{p}"),
    ("blocks.{n}.ffn.net.2.{p}", "blocks.{n}.ffn.fc_out.{p}"),
    ("blocks.{n}.norm2.{p}", "blocks.{n}.self_attn_residual_norm.norm.{p}"),
)

_WAN_NAMES: tuple[tuple[str, str], ...] = (
    ("condition_embedder.text_embedder.linear_1.{p}", "text_embedding.0.{p}"),
    ("condition_embedder.text_embedder.linear_2.{p}", "text_embedding.2.{p}"),
    ("condition_embedder.time_embedder.linear_1.{p}", "time_embedding.0.{p}"),
    ("condition_embedder.time_embedder.linear_2.{p}", "time_embedding.2.{p}"),
    ("condition_embedder.time_proj.{p}", "time_projection.1.{p}"),
    ("proj_out.{p}", "head.head.{p}"),
    ("scale_shift_table", "head.modulation"),
    ("blocks.{n}.scale_shift_table", "blocks.{n}.modulation"),
    ("blocks.{n}.attn1.to_q.{p}", "blocks.{n}.self_attn.q.{p}"),
    ("blocks.{n}.attn1.to_k.{p}", "blocks.{n}.self_attn.k.{p}"),
    ("blocks.{n}.attn1.to_v.{p}", "blocks.{n}.self_attn.v.{p}"),
    ("blocks.{n}.attn1.to_out.0.{p}", "blocks.{n}.self_attn.o.{p}"),
    ("blocks.{n}.attn1.norm_q.{p}", "blocks.{n}.self_attn.norm_q.{p}"),
    ("blocks.{n}.attn1.norm_k.{p}", "blocks.{n}.self_attn.norm_k.{p}"),
    ("blocks.{n}.attn2.to_q.{p}", "blocks.{n}.cross_attn.q.{p}"),
    ("blocks.{n}.attn2.to_k.{p}", "blocks.{n}.cross_attn.k.{p}"),
    ("blocks.{n}.attn2.to_v.{p}", "blocks.{n}.cross_attn.v.{p}"),
    ("blocks.{n}.attn2.to_out.0.{p}", "blocks.{n}.cross_attn.o.{p}"),
    ("blocks.{n}.attn2.norm_q.{p}", "blocks.{n}.cross_attn.norm_q.{p}"),
    ("blocks.{n}.attn2.norm_k.{p}", "blocks.{n}.cross_attn.norm_k.{p}"),
    ("blocks.{n}.ffn.net.0.proj.{p}", "blocks.{n}.ffn.0.{p}"),
    ("blocks.{n}.ffn.net.2.{p}", "blocks.{n}.ffn.2.{p}"),
    ("blocks.{n}.norm2.{p}", "blocks.{n}.norm3.{p}"),   # the norm swap (module docstring)
    ("blocks.{n}.norm3.{p}", "blocks.{n}.norm2.{p}"),
)

_FIELDS = {"n": r"(?P<n>\d+)", "p": r"(?P<p>[A-Za-z0-9_]+)"}


def _template_regex(template: str) -> re.Pattern:
    parts = re.split(r"\{(\w)\}", template)  # literal, field, literal, field, …
    body = "".join(re.escape(x) if i % 2 == 0 else _FIELDS[x] for i, x in enumerate(parts))
    return re.compile(f"^{body}$")


def _rules(pairs: tuple[tuple[str, str], ...], reverse: bool) -> tuple[tuple[re.Pattern, str], ...]:
    """(compiled source pattern, target template) for one direction of a rule table."""
    return tuple((_template_regex(b if reverse else a), a if reverse else b) for a, b in pairs)


_TO_OTHER = {"fastvideo": _rules(_FASTVIDEO_NAMES, False), "wan": _rules(_WAN_NAMES, False)}
_TO_DIFFUSERS = {"fastvideo": _rules(_FASTVIDEO_NAMES, True), "wan": _rules(_WAN_NAMES, True)}

# Keys that only one scheme produces.
_MARKERS = {
    "diffusers": re.compile(r"^blocks\.\d+\.(attn1\.|ffn\.net\.)|^condition_embedder\.(time|text)_embedder\.linear_"
                            r"|^condition_embedder\.time_proj\."),
    "fastvideo": re.compile(r"^blocks\.\d+\.(to_[qkv]|to_out|norm_[qk]|self_attn_residual_norm|ffn\.fc_)"
                            r"|^blocks\.\d+\.attn2\.to_out\.(weight|bias)$|^patch_embedding\.proj\."
                            r"|time_modulation|\.fc_in\.|\.fc_out\."),
    "wan": re.compile(r"^blocks\.\d+\.(self_attn\.|cross_attn\.|modulation$|ffn\.\d)"
                      r"|^(head\.|text_embedding\.|time_embedding\.|time_projection\.)"),
}


class CheckpointError(ValueError):
    """A checkpoint cannot be read, or does not fit the model; the message lists what and where."""


@dataclass
class CheckpointInfo:
    """How a checkpoint was read: its ``path``, the naming ``scheme`` detected, the ``prefix``
    stripped from every key ('' if none), the tensor count, the folder's note, if any, and what
    its ``attnqat.json`` says the weights are (``weights``, e.g. ``"copy-of-base"``), if it says."""

    path: str
    scheme: str
    prefix: str
    tensors: int
    note: str | None = None
    weights: str | None = None


def _rename(name: str, rules) -> str:
    for pattern, template in rules:
        m = pattern.match(name)
        if m:
            return template.format(**m.groupdict())
    return name


def strip_prefix(state_dict: Mapping[str, Any]) -> tuple[dict[str, Any], str]:
    """Remove known wrapper prefixes (``model.diffusion_model.``, ``module.``, ``_orig_mod.``, …)
    that EVERY key carries. Returns (new dict, the prefix removed)."""
    sd = dict(state_dict)
    removed = ""
    changed = True
    while changed and sd:
        changed = False
        for prefix in KNOWN_PREFIXES:
            if all(k.startswith(prefix) for k in sd):
                sd = {k[len(prefix):]: v for k, v in sd.items()}
                removed += prefix
                changed = True
                break
    return sd, removed


def detect_scheme(keys) -> str:
    """``"diffusers"``, ``"fastvideo"`` or ``"wan"`` from the key names.

    Raises:
        CheckpointError: no key looks like any scheme, or keys of several schemes are mixed.
    """
    keys = list(keys)
    hits = {s: [k for k in keys if m.search(k)] for s, m in _MARKERS.items()}
    found = [s for s, ks in hits.items() if ks]
    if len(found) == 1:
        return found[0]
    if not found:
        sample = ", ".join(sorted(keys)[:5]) or "(no tensors)"
        raise CheckpointError(
            "cannot tell the naming scheme of this Wan transformer checkpoint: expected keys like "
            "'blocks.0.attn1.to_q.weight' (diffusers), 'blocks.0.to_q.weight' (FastVideo) or "
            f"'blocks.0.self_attn.q.weight' (original Wan); found e.g. {sample}")
    parts = "; ".join(f"{len(hits[s])} key(s) look like {s} (e.g. {hits[s][0]})" for s in found)
    raise CheckpointError(f"the checkpoint mixes naming schemes: {parts}")


def to_diffusers(state_dict: Mapping[str, Any], scheme: str | None = None) -> tuple[dict[str, Any], str]:
    """Rename a Wan transformer state dict to diffusers' names.

    Args:
        state_dict: tensors under diffusers, FastVideo or original-Wan names (prefix already
            stripped, see :func:`strip_prefix`).
        scheme: the scheme, or None to detect it.

    Returns:
        (renamed dict, scheme). The tensors themselves are not copied.
    """
    scheme = scheme or detect_scheme(state_dict.keys())
    if scheme not in SCHEMES:
        raise ValueError(f"unknown naming scheme {scheme!r}; expected one of {', '.join(SCHEMES)}")
    if scheme == "diffusers":
        return dict(state_dict), scheme
    rules = _TO_DIFFUSERS[scheme]
    out: dict[str, Any] = {}
    for name, tensor in state_dict.items():
        new = _rename(name, rules)
        if new in out:
            raise CheckpointError(f"two tensors map to the same diffusers name {new!r} "
                                  f"(one of them is {name!r})")
        out[new] = tensor
    return out, scheme


def from_diffusers(state_dict: Mapping[str, Any], scheme: str) -> dict[str, Any]:
    """Rename a diffusers Wan transformer state dict to ``scheme`` (inverse of :func:`to_diffusers`)."""
    if scheme not in SCHEMES:
        raise ValueError(f"unknown naming scheme {scheme!r}; expected one of {', '.join(SCHEMES)}")
    if scheme == "diffusers":
        return dict(state_dict)
    rules = _TO_OTHER[scheme]
    return {_rename(k, rules): v for k, v in state_dict.items()}


# ----------------------------------------------------------------------------------------------
# Reading files
# ----------------------------------------------------------------------------------------------

def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            return {k: f.get_tensor(k) for k in f.keys()}
    except Exception as exc:  # noqa: BLE001 - SafetensorError, OSError, truncated data …
        raise CheckpointError(f"cannot read {path}: it is corrupted or not a safetensors file "
                              f"({type(exc).__name__}: {exc})") from exc


def checkpoint_files(path: str | Path) -> list[Path]:
    """The ``.safetensors`` files of a checkpoint: the file itself, the shards a folder's
    ``*.safetensors.index.json`` lists, or every ``.safetensors`` file of the folder."""
    p = Path(path).expanduser()
    if not p.exists():
        raise CheckpointError(f"checkpoint not found: {path}")
    if p.is_file():
        if p.suffix != ".safetensors":
            raise CheckpointError(f"{p} is not a .safetensors file (only safetensors checkpoints "
                                  "are read)")
        return [p]
    indexes = sorted(p.glob("*.safetensors.index.json"))
    if len(indexes) > 1:
        raise CheckpointError(f"{p} holds several shard indexes: {', '.join(i.name for i in indexes)}")
    if indexes:
        try:
            weight_map = json.loads(indexes[0].read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as exc:
            raise CheckpointError(f"cannot read the shard index {indexes[0]}: {exc}") from exc
        files = [p / f for f in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{indexes[0].name} lists shard(s) missing from {p}: {', '.join(missing)}")
        return files
    files = sorted(p.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no .safetensors file in {p}")
    return files


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint (file or folder, see :func:`checkpoint_files`), on the CPU."""
    out: dict[str, torch.Tensor] = {}
    for f in checkpoint_files(path):
        for k, v in _read_safetensors(f).items():
            if k in out:
                raise CheckpointError(f"tensor {k!r} appears in more than one file of {path}")
            out[k] = v
    return out


# ----------------------------------------------------------------------------------------------
# Checking and loading
# ----------------------------------------------------------------------------------------------

_ARCH_KEYS = ("patch_size", "num_attention_heads", "attention_head_dim", "in_channels", "out_channels",
              "text_dim", "freq_dim", "ffn_dim", "num_layers", "cross_attn_norm", "qk_norm",
              "image_dim", "added_kv_proj_dim", "pos_embed_seq_len")


def _listing(names: list[str], limit: int = 12) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", … ({len(names) - limit} more)" if len(names) > limit else "")


def check_state_dict(state_dict: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Size],
                     where: str = "the checkpoint", scheme: str | None = None,
                     file_names: Mapping[str, str] | None = None) -> None:
    """Compare tensor names and shapes with the model's; raise one error listing every problem.

    ``state_dict`` is under diffusers' names; ``file_names`` maps them back to the names in the file
    (for the message). With a non-diffusers ``scheme``, missing tensors are also shown under the
    name the file should have used.

    Raises:
        CheckpointError: unknown tensors (no place in the model), missing parameters, shape
            mismatches — each by name.
    """
    file_names = file_names or {}

    def shown(k: str) -> str:
        old = file_names.get(k, k)
        return k if old == k else f"{k} (in the file: {old})"

    def shown_missing(k: str) -> str:
        if scheme in (None, "diffusers"):
            return k
        other = from_diffusers({k: None}, scheme)
        name = next(iter(other))
        return k if name == k else f"{k} (expected in the file as {name})"

    unknown = [file_names.get(k, k) for k in sorted(set(state_dict) - set(expected))]
    missing = [shown_missing(k) for k in sorted(set(expected) - set(state_dict))]
    shapes = sorted(f"{shown(k)}: checkpoint {tuple(state_dict[k].shape)} vs model {tuple(expected[k])}"
                    for k in set(state_dict) & set(expected)
                    if tuple(state_dict[k].shape) != tuple(expected[k]))
    problems = []
    if unknown:
        problems.append(f"{len(unknown)} unknown tensor(s) with no place in the model (names as in "
                        f"the file): {_listing(unknown)}")
    if missing:
        problems.append(f"{len(missing)} missing tensor(s): {_listing(missing)}")
    if shapes:
        problems.append(f"{len(shapes)} tensor(s) with the wrong shape: {_listing(shapes, 8)}")
    if problems:
        named = f" (read as the {scheme} naming scheme)" if scheme else ""
        raise CheckpointError(f"{where} does not fit the Wan transformer{named}: " + "; ".join(problems))


def _config_of(path: Path, config: Mapping[str, Any] | None) -> dict[str, Any]:
    """The transformer config: the folder's config.json (checked against ``config`` if both), or
    ``config`` for a single file."""
    own = None
    if path.is_dir() and (path / "config.json").is_file():
        try:
            own = json.loads((path / "config.json").read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"cannot read {path / 'config.json'}: {exc}") from exc
        if own.get("_class_name", "WanTransformer3DModel") != "WanTransformer3DModel":
            raise CheckpointError(f"{path} holds a {own.get('_class_name')!r}, expected a WanTransformer3DModel")
    if own is not None and config is not None:
        diffs = []
        for k in _ARCH_KEYS:
            a, b = own.get(k), config.get(k)
            if k not in own or k not in config:
                continue
            if (list(a) if isinstance(a, (list, tuple)) else a) != (list(b) if isinstance(b, (list, tuple)) else b):
                diffs.append(f"{k} {a} vs {b}")
        if diffs:
            raise CheckpointError(f"the transformer in {path} does not match the base transformer "
                                  f"(checkpoint vs base): {', '.join(diffs)}")
    cfg = own if own is not None else (dict(config) if config is not None else None)
    if cfg is None:
        raise CheckpointError(f"{path} has no config.json; loading a single checkpoint file needs the "
                              "base transformer's config")
    return {k: v for k, v in cfg.items() if not k.startswith("_")}


def param_dtype(model, name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype a Wan transformer parameter ``name`` is kept in when the model is loaded in
    ``dtype``: float32 for the modules diffusers keeps in float32 (norms, time embedder,
    modulation tables: ``_keep_in_fp32_modules``), else ``dtype``."""
    keep = set(getattr(model, "_keep_in_fp32_modules", None) or [])
    return torch.float32 if keep.intersection(name.split(".")) else dtype


def load_wan_transformer(path: str | Path, *, config: Mapping[str, Any] | None = None,
                         dtype: torch.dtype = torch.bfloat16,
                         device: str | torch.device = "cpu"):
    """Load a Wan 2.1 transformer from a diffusers transformer folder or a ``.safetensors`` file.

    The naming scheme (diffusers, FastVideo, original Wan) is detected from the keys, wrapper prefixes
    are stripped, names are converted to diffusers' and the result is checked against the model
    before any weight is assigned.

    Args:
        path: a folder with ``config.json`` and ``*.safetensors`` (sharded or not), a folder of
            ``.safetensors`` files, or one ``.safetensors`` file.
        config: the base transformer's config. Needed for a single file; for a folder with its own
            ``config.json`` it must agree on the architecture.
        dtype: floating dtype of the parameters; the modules diffusers keeps in float32 (norms, time
            embedder, modulation tables) stay float32, as ``from_pretrained`` does.
        device: where the loaded model is put.

    Returns:
        (``WanTransformer3DModel``, :class:`CheckpointInfo`).

    Raises:
        CheckpointError: unreadable or corrupted file, unknown scheme, or tensors that do not fit
            (each named).
    """
    from accelerate import init_empty_weights
    from diffusers import WanTransformer3DModel

    p = Path(path).expanduser()
    if not p.exists():
        raise CheckpointError(f"checkpoint not found: {path}")
    cfg = _config_of(p, config)
    raw = read_state_dict(p)
    stripped, prefix = strip_prefix(raw)
    converted, scheme = to_diffusers(stripped)
    file_names = dict(zip(converted, (prefix + k for k in stripped)))
    with init_empty_weights():
        model = WanTransformer3DModel.from_config(cfg)
    expected = {k: v.shape for k, v in model.state_dict().items()}
    check_state_dict(converted, expected, where=str(p), scheme=scheme, file_names=file_names)
    ready = {k: t.to(param_dtype(model, k, dtype)) if t.is_floating_point() else t
             for k, t in converted.items()}
    model.load_state_dict(ready, strict=True, assign=True)
    model.to(device)
    model.eval()
    try:
        meta = sidecar.read(p) if p.is_dir() else None
    except sidecar.SidecarError as exc:
        raise CheckpointError(str(exc)) from exc
    return model, CheckpointInfo(path=str(p.resolve()), scheme=scheme, prefix=prefix,
                                 tensors=len(raw), note=meta.note if meta else None,
                                 weights=meta.weights if meta else None)


__all__ = ["CheckpointError", "CheckpointInfo", "KNOWN_PREFIXES", "SCHEMES", "check_state_dict",
           "checkpoint_files", "detect_scheme", "from_diffusers", "load_wan_transformer", "param_dtype",
           "read_state_dict", "strip_prefix", "to_diffusers"]

"""The embedded tiny Wan 2.1 pipeline: small enough for a 2-core CPU, same classes as the real one.

It is a real diffusers :class:`~diffusers.WanPipeline` made of

* a word-level tokenizer built with ``tokenizers`` (:func:`build_tokenizer`) over a vocabulary of
  the synthetic-shapes captions plus common English words of the prompts (:func:`tiny_vocabulary`),
* a small ``UMT5EncoderModel``,
* a small ``AutoencoderKLWan`` (8× spatial, 4× temporal compression, 16 latent channels, as Wan),
* a small ``WanTransformer3DModel`` (attention head_dim 64, which the GPU kernels support),
* the UniPC flow-matching scheduler with Wan's settings.

It is saved with ``save_pretrained`` in ``assets/tiny-wan/`` and loaded by exactly the code path
of a real checkpoint (:func:`attnqat.wan.load_pipeline`). Beside it, ``assets/tiny-wan-qat/`` holds a
tiny Attn-QAT transformer (a diffusers transformer folder). Until the QAT fine-tuning has been run on
it, that transformer is a copy of the base transformer's weights and its ``attnqat.json`` says so.

Both folders carry an ``attnqat.json`` sidecar (ignored by diffusers) with the model's generation
defaults, the seed it was built from and a note on where its weights come from.

The shipped weights are trained on the synthetic shapes data by ``attnqat finetune tiny``
(:mod:`attnqat.finetune.tiny_train`, ``docs/tiny_model.md``), which starts from
:func:`build_tiny_pipeline` and writes the folders with :func:`save_pipeline`. A random
initialization of the same architecture (what training starts from) is written by::

    python -m attnqat.tiny --out DIR --qat-out DIR-qat --seed 0

which refuses to replace trained weights unless ``--force`` is given.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Iterable

import torch

from . import sidecar as sc
from .convert import param_dtype
from .sidecar import SIDECAR  # noqa: F401  (the file name; callers read it from here too)

# The package attnqat.assets wherever it is installed: the repository's assets/ in an editable
# install, site-packages/attnqat/assets in a regular one.
ASSETS_DIR = Path(str(resources.files("attnqat.assets"))).resolve()
TINY_MODEL_DIR = ASSETS_DIR / "tiny-wan"
TINY_QAT_DIR = ASSETS_DIR / "tiny-wan-qat"

PAD, EOS, UNK = "<pad>", "</s>", "<unk>"
SPECIAL_TOKENS = (PAD, EOS, UNK)  # ids 0, 1, 2 as in UMT5

# Words of the synthetic shapes captions ("a red circle moves left on a blue background").
SHAPES = ("circle", "square", "triangle")
COLOURS = ("red", "green", "blue", "yellow", "orange", "purple", "pink", "cyan", "magenta",
           "white", "black", "gray", "grey", "brown")
DIRECTIONS = ("left", "right", "up", "down")
CAPTION_WORDS = ("a", "an", "the", "moves", "moving", "move", "grows", "shrinks", "grow", "shrink",
                 "growing", "shrinking", "on", "background", "and", "to",
                 "towards", "toward", "of", "in", "across", "slowly", "quickly", "fast", "slow",
                 "small", "large", "big", "shape", "shapes", "circles", "squares", "triangles",
                 "frame", "screen", "plain", "solid", "colored", "coloured")
# Common English words of the prompts people type, and of Wan's usual negative prompt.
COMMON_WORDS = (
    "is", "are", "was", "with", "at", "by", "for", "from", "into", "over", "under", "through",
    "while", "as", "it", "its", "this", "that", "these", "there", "then", "very", "two", "three",
    "one", "many", "some", "no", "not", "each", "other", "again", "around", "back", "forth",
    "top", "bottom", "center", "centre", "middle", "side", "corner", "edge", "upward", "downward",
    "bright", "dark", "light", "tones", "overexposed", "static", "blurred", "blurry", "details",
    "subtitles", "style", "works", "paintings", "painting", "images", "image", "overall", "worst",
    "quality", "low", "high", "jpeg", "compression", "residue", "ugly", "incomplete", "extra",
    "fingers", "poorly", "drawn", "hands", "faces", "face", "deformed", "disfigured", "misshapen",
    "limbs", "fused", "still", "picture", "messy", "legs", "people", "walking", "backwards",
    "video", "clip", "scene", "camera", "view", "shot", "motion", "smooth", "sharp", "clear",
    "detailed", "beautiful", "realistic", "cinematic", "simple", "flat", "animation", "cartoon",
    "object", "objects", "ball", "box", "cat", "dog", "bird", "car", "tree", "sky", "sun", "sea",
    "water", "road", "city", "house", "man", "woman", "person", "running", "flying", "rolling",
    "bouncing", "sliding", "spinning", "rotating", "floating", "falling", "rising", "jumping",
    "turns", "goes", "comes", "stays", "stops", "starts", "appears", "disappears",
)


def tiny_vocabulary() -> list[str]:
    """The tiny model's vocabulary (without special tokens): caption words plus common words,
    lower case, first occurrence kept, in a fixed order."""
    words: list[str] = []
    for group in (SHAPES, COLOURS, DIRECTIONS, CAPTION_WORDS, COMMON_WORDS):
        for w in group:
            if w not in words:
                words.append(w)
    return words + list(",.!?;:'\"-()")


def build_tokenizer(words: Iterable[str], model_max_length: int = 512):
    """A word-level tokenizer over ``words``, usable by :class:`~diffusers.WanPipeline`.

    Lower-cases, splits on whitespace and punctuation, maps unknown words to ``<unk>`` and appends
    ``</s>`` like UMT5's tokenizer. Ids: ``<pad>`` 0, ``</s>`` 1, ``<unk>`` 2, then ``words`` in the
    given order (duplicates dropped).

    Returns:
        a :class:`transformers.PreTrainedTokenizerFast` (``save_pretrained`` / ``AutoTokenizer``).
    """
    from tokenizers import Tokenizer, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab: dict[str, int] = {}
    for w in (*SPECIAL_TOKENS, *(str(w).strip().lower() for w in words)):
        if not w:
            continue
        if any(c.isspace() for c in w):
            raise ValueError(f"vocabulary entries must be single words, got {w!r}")
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(WordLevel(vocab=vocab, unk_token=UNK))
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single=f"$A {EOS}", pair=f"$A {EOS} $B {EOS}", special_tokens=[(EOS, vocab[EOS])])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOS,
                                   unk_token=UNK, model_max_length=model_max_length,
                                   padding_side="right")


@dataclass(frozen=True)
class TinyWanConfig:
    """Sizes of the tiny pipeline. The defaults are the architecture of the shipped, trained
    ``assets/tiny-wan`` (``docs/tiny_model.md``)."""

    # transformer
    num_attention_heads: int = 4
    attention_head_dim: int = 64
    num_layers: int = 8
    ffn_dim: int = 1024
    freq_dim: int = 64
    # text encoder (its d_model is the transformer's text_dim)
    text_d_model: int = 256
    text_layers: int = 3
    text_heads: int = 4
    text_d_ff: int = 512
    # VAE
    vae_base_dim: int = 16
    vae_res_blocks: int = 1
    z_dim: int = 16
    # generation defaults written into the sidecar
    defaults: dict = field(default_factory=lambda: {
        "height": 128, "width": 128, "frames": 33, "fps": 16, "steps": 20,
        "guidance": 5.0, "shift": 3.0, "max_sequence_length": 32})


def _transformer_config(cfg: TinyWanConfig) -> dict:
    return dict(patch_size=(1, 2, 2), num_attention_heads=cfg.num_attention_heads,
                attention_head_dim=cfg.attention_head_dim, in_channels=cfg.z_dim,
                out_channels=cfg.z_dim, text_dim=cfg.text_d_model, freq_dim=cfg.freq_dim,
                ffn_dim=cfg.ffn_dim, num_layers=cfg.num_layers, cross_attn_norm=True,
                qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)


def _scheduler(shift: float):
    from diffusers import UniPCMultistepScheduler

    # Wan 2.1's scheduler settings (flow-matching UniPC, shift 3 at 480p / 5 at 720p).
    return UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                   num_train_timesteps=1000, flow_shift=shift, solver_order=2,
                                   solver_type="bh2", lower_order_final=True,
                                   final_sigmas_type="zero", timestep_spacing="linspace")


def build_tiny_pipeline(seed: int = 0, config: TinyWanConfig | None = None):
    """Build the tiny :class:`~diffusers.WanPipeline` with random weights drawn from ``seed``.

    Deterministic: the same seed and config give bit-identical weights. Everything is float32
    here; :func:`attnqat.wan.load_pipeline` casts on load as for a real checkpoint.
    """
    from diffusers import AutoencoderKLWan, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    cfg = config or TinyWanConfig()
    tokenizer = build_tokenizer(tiny_vocabulary())
    vocab_size = -(-len(tokenizer) // 64) * 64
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        text_encoder = UMT5EncoderModel(UMT5Config(
            vocab_size=vocab_size, d_model=cfg.text_d_model, d_kv=cfg.text_d_model // cfg.text_heads,
            d_ff=cfg.text_d_ff, num_layers=cfg.text_layers, num_heads=cfg.text_heads,
            relative_attention_num_buckets=16, relative_attention_max_distance=64,
            dropout_rate=0.0, feed_forward_proj="gated-gelu", tie_word_embeddings=False,
            pad_token_id=0, eos_token_id=1, decoder_start_token_id=0, is_encoder_decoder=False))
        vae = AutoencoderKLWan(base_dim=cfg.vae_base_dim, z_dim=cfg.z_dim, dim_mult=[1, 2, 4, 4],
                               num_res_blocks=cfg.vae_res_blocks, attn_scales=[],
                               temperal_downsample=[False, True, True], dropout=0.0,
                               latents_mean=[0.0] * cfg.z_dim, latents_std=[1.0] * cfg.z_dim)
        transformer = WanTransformer3DModel(**_transformer_config(cfg))
    finally:
        torch.random.set_rng_state(state)
    for m in (text_encoder, vae, transformer):
        m.eval()
    return WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae,
                       scheduler=_scheduler(cfg.defaults["shift"]), transformer=transformer)


def _chmod_like_mkdir(path: Path) -> None:
    """Give a ``mkdtemp`` folder (0700) the permissions a plain ``mkdir`` would."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o777 & ~umask)


def _chmod_files(folder: Path) -> None:
    """Files written through temporary files may be 0600; give them plain-file permissions."""
    umask = os.umask(0)
    os.umask(umask)
    for f in folder.rglob("*"):
        os.chmod(f, (0o777 if f.is_dir() else 0o666) & ~umask)


def _portable_tokenizer_class(folder: Path) -> None:
    """Name the tokenizer class ``PreTrainedTokenizerFast``, which transformers 4 and 5 both know
    (transformers 5 writes its new internal name)."""
    index = folder / "model_index.json"
    meta = json.loads(index.read_text())
    meta["tokenizer"] = ["transformers", "PreTrainedTokenizerFast"]
    index.write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    cfg_path = folder / "tokenizer" / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def save_pipeline(pipe, out: str | Path, qat_out: str | Path | None = None, *,
                  sidecar: sc.Sidecar | dict, qat_sidecar: sc.Sidecar | dict | None = None
                  ) -> tuple[Path, Path | None]:
    """Save a tiny :class:`~diffusers.WanPipeline` (diffusers layout, safetensors) with its sidecar.

    ``out`` receives the pipeline and ``sidecar`` (a :class:`attnqat.sidecar.Sidecar`, or the dict
    of an older caller) as ``attnqat.json`` (``qat_transformer`` is added
    when ``qat_out`` is given); ``qat_out`` (unless None) receives a copy of the pipeline's
    transformer with ``qat_sidecar``. The transformer and text encoder are stored in bfloat16 (the
    dtype they are loaded in), except the transformer's modules diffusers keeps in float32; the VAE
    stays float32. ``pipe`` itself is not modified. Existing folders are replaced only after the new
    ones were written completely.

    Returns:
        the two folders written (``qat_out`` None when not asked).
    """
    import copy

    from diffusers import WanPipeline

    out = Path(out).resolve()
    qat = Path(qat_out).resolve() if qat_out is not None else None
    transformer = copy.deepcopy(pipe.transformer).to("cpu")
    text_encoder = copy.deepcopy(pipe.text_encoder).to("cpu", torch.bfloat16)
    with torch.no_grad():
        for name, p in transformer.named_parameters():
            p.data = p.data.to(param_dtype(transformer, name, torch.bfloat16))
    vae = copy.deepcopy(pipe.vae).to("cpu")
    with torch.no_grad():
        for p in vae.parameters():
            p.data = p.data.float()
    pipe = WanPipeline(tokenizer=pipe.tokenizer, text_encoder=text_encoder, vae=vae,
                       scheduler=pipe.scheduler, transformer=transformer)
    sidecar = sc.Sidecar.from_dict(sidecar) if isinstance(sidecar, dict) else replace(sidecar)
    out.parent.mkdir(parents=True, exist_ok=True)
    if qat is not None:
        qat.parent.mkdir(parents=True, exist_ok=True)
        sidecar.qat_transformer = Path(os.path.relpath(qat, out)).as_posix()
    written: list[tuple[Path, Path]] = []
    try:
        tmp = Path(tempfile.mkdtemp(prefix=".tiny-wan-", dir=out.parent))
        _chmod_like_mkdir(tmp)
        written.append((tmp, out))
        pipe.save_pretrained(tmp, safe_serialization=True)
        _portable_tokenizer_class(tmp)
        sc.write(tmp, sidecar)
        _chmod_files(tmp)
        if qat is not None:
            tmpq = Path(tempfile.mkdtemp(prefix=".tiny-wan-qat-", dir=qat.parent))
            _chmod_like_mkdir(tmpq)
            written.append((tmpq, qat))
            transformer.save_pretrained(tmpq, safe_serialization=True)
            sc.write(tmpq, qat_sidecar if qat_sidecar is not None else sc.Sidecar(kind="tiny-wan-qat"))
            _chmod_files(tmpq)
    except BaseException:
        for tmp_dir, _ in written:
            shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    for tmp_dir, final in written:
        if final.exists():
            shutil.rmtree(final)
        tmp_dir.rename(final)
    return out, qat


def save_tiny_assets(out: str | Path = TINY_MODEL_DIR, qat_out: str | Path | None = TINY_QAT_DIR,
                     seed: int = 0, config: TinyWanConfig | None = None) -> tuple[Path, Path | None]:
    """Build the tiny pipeline from ``seed`` (random weights) and save it with
    :func:`save_pipeline`.

    ``out`` receives the pipeline, ``qat_out`` (unless None) its Attn-QAT transformer: a copy of
    the base transformer's weights, stated in its ``attnqat.json``.

    Returns:
        the two folders written (``qat_out`` None when not asked).
    """
    cfg = config or TinyWanConfig()
    pipe = build_tiny_pipeline(seed, cfg)
    weights_note = (f"random initialization from seed {seed} (not trained); generated clips are "
                    "noise-like; the trained tiny model comes from `attnqat finetune tiny`")
    sidecar = sc.Sidecar(kind="tiny-wan", weights="random-init", seed=seed, weights_note=weights_note,
                         defaults=dict(cfg.defaults), config=config_dict(cfg))
    return save_pipeline(pipe, out, qat_out, sidecar=sidecar,
                         qat_sidecar=copy_of_base_sidecar(seed))


def config_dict(cfg: TinyWanConfig) -> dict:
    """The architecture fields of ``cfg`` (everything but the generation defaults)."""
    return {k: v for k, v in asdict(cfg).items() if k != "defaults"}


def copy_of_base_sidecar(seed: int | None = None, note: str | None = None) -> sc.Sidecar:
    """The ``attnqat.json`` of an Attn-QAT folder that holds a copy of the base transformer."""
    return sc.Sidecar(kind="tiny-wan-qat", weights="copy-of-base", seed=seed,
                      qat_weights_note=note or ("copy of the base tiny transformer's weights: Attn-QAT "
                                                "fine-tuning has not been run on it yet, so the attnqat "
                                                "clip shows plain NVFP4 attention on the base model"))


def main(argv: list[str] | None = None) -> int:
    """``python -m attnqat.tiny``: rebuild the embedded tiny pipeline from a seed."""
    parser = argparse.ArgumentParser(
        prog="python -m attnqat.tiny",
        description="Rebuild the embedded tiny Wan pipeline (random weights from a seed) and its "
                    "tiny Attn-QAT transformer, in diffusers format.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--out", type=Path, default=TINY_MODEL_DIR,
                        help="folder for the pipeline (replaced if it exists)")
    parser.add_argument("--qat-out", type=Path, default=TINY_QAT_DIR,
                        help="folder for the tiny Attn-QAT transformer (replaced if it exists)")
    parser.add_argument("--no-qat", action="store_true", help="do not write the Attn-QAT transformer")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random initialization")
    parser.add_argument("--force", action="store_true",
                        help="replace a folder that holds trained weights (its attnqat.json says "
                             "weights other than random-init)")
    args = parser.parse_args(argv)
    targets = [args.out] + ([] if args.no_qat else [args.qat_out])
    for folder in targets:
        side = sc.read(folder)
        if side is not None and not args.force:
            weights = side.weights
            if weights not in (None, "random-init", "copy-of-base"):
                parser.error(f"{folder} holds {weights} weights; pass --force to replace them with a "
                             "random initialization")
    out, qat = save_tiny_assets(args.out, None if args.no_qat else args.qat_out, seed=args.seed)
    size = sum(p.stat().st_size for d in (out, qat) if d for p in d.rglob("*") if p.is_file())
    print(f"wrote {out}" + (f" and {qat}" if qat else "") + f" ({size / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

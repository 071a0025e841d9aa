"""Stage ``vae`` of ``attnqat finetune tiny``: train the tiny model's ``AutoencoderKLWan`` (or its
decoder) on synthetic clips drawn on the device, then measure the per-channel statistics of its
latents; and the encoding of clips that the text-to-video stage reuses."""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from attnqat.finetune.schedule import lr_factor
from attnqat.finetune.tiny_config import STREAM_STATS, STREAM_VAE, TinyTrainConfig
from attnqat.finetune.tiny_context import Budget, Context, autocast, log
from attnqat.synthetic import render_batch, spec_batches, to_tensor


def vae_loss(vae, x: torch.Tensor, fg: torch.Tensor, kl_weight: float, fg_weight: float,
             generator: torch.Generator | None = None, sample: bool = False
             ) -> tuple[torch.Tensor, dict]:
    """Reconstruction (L1 + L2, object pixels weighted ``1 + fg_weight``) of the posterior mean
    (or, with ``sample``, of a posterior sample), plus ``kl_weight`` times the KL to N(0, 1)
    averaged over latent elements. The text-to-video stage and the pipeline only ever use the
    mean."""
    post = vae.encode(x).latent_dist
    z = post.sample(generator=generator) if sample else post.mode()
    rec = vae.decode(z).sample.float()
    wgt = 1.0 + fg_weight * fg.unsqueeze(1).float()
    err = rec - x
    l1 = (err.abs() * wgt).mean() / wgt.mean()
    l2 = (err.square() * wgt).mean() / wgt.mean()
    mean, logvar = post.mean.float(), post.logvar.float()
    kl = 0.5 * (mean.square() + logvar.exp() - 1.0 - logvar).mean()
    loss = l1 + l2 + kl_weight * kl
    return loss, {"l1": l1.item(), "l2": l2.item(), "kl": kl.item()}


def train_vae(pipe, cfg: TinyTrainConfig, ctx: Context, state: dict, record: dict) -> None:
    """Train the VAE (or its decoder); totals go to ``state["vae"]``, this run's settings and
    counts to ``record``."""
    r, o, dev = cfg.run, cfg.vae, ctx.dev
    vae = pipe.vae.to(dev).train().requires_grad_(True)
    if o.train == "decoder":
        vae.encoder.requires_grad_(False)
        vae.quant_conv.requires_grad_(False)
    trainable = [p for p in vae.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=o.lr, betas=(0.9, 0.99), weight_decay=0.0)
    gen = torch.Generator(dev).manual_seed(r.seed * 7 + 1)
    st = state.setdefault("vae", {"steps": 0, "clips": 0, "seconds": 0.0})
    batches = spec_batches(r.seed * 1000 + STREAM_VAE, st["clips"], o.batch_size,
                           r.workers)
    budget = Budget(o.steps, o.minutes, ctx.clock)
    log(f"vae: {sum(p.numel() for p in trainable) / 1e6:.2f} M parameters trained "
        f"({o.train}), batch "
        f"{o.batch_size} x {o.frames} x {r.size}^2, budget "
        f"{o.steps or '-'} steps / {budget.seconds / 60:.1f} min")
    step, t_last, t_data, seen = 0, time.perf_counter(), 0.0, 0
    while not budget.done(step):
        t_d = time.perf_counter()
        params, _ = next(batches)
        clips, fg = render_batch(params.to(dev), o.frames, r.size)
        x = to_tensor(clips)
        t_data += time.perf_counter() - t_d
        for g in opt.param_groups:
            g["lr"] = o.lr * lr_factor(step, budget.progress(step), warmup=100,
                                              schedule="linear_tail", decay_frac=0.2, final=0.1)
        with autocast(dev):
            loss, parts = vae_loss(vae, x, fg, o.kl_weight, o.fg_weight, gen, o.sample)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        opt.step()
        step += 1
        seen += x.shape[0]
        if step % r.log_every == 0 or step == 1:
            dt = time.perf_counter() - t_last
            if ctx.runlog is not None:
                ctx.runlog.write(st["steps"] + step, "vae", loss=loss.item(), **parts,
                                  grad_norm=float(gnorm), lr=opt.param_groups[0]["lr"],
                                  clips_per_s=seen / dt)
            log(f"vae step {st['steps'] + step:6d}  loss {loss.item():.4f}  l1 {parts['l1']:.4f} "
                f"l2 {parts['l2']:.5f} kl {parts['kl']:.2f}  gnorm {float(gnorm):.2f}  "
                f"{seen / dt:.1f} clips/s  data {100 * t_data / dt:.0f}%  "
                f"t {ctx.clock.elapsed():.0f}s")
            t_last, t_data, seen = time.perf_counter(), 0.0, 0
    batches.close()
    st["steps"] += step
    st["clips"] += step * o.batch_size
    st["seconds"] += time.perf_counter() - budget.t0
    st["final_loss"] = loss.item() if step else st.get("final_loss")
    st.setdefault("decoder_only_steps", 0)
    if o.train == "decoder":
        st["decoder_only_steps"] += step
    record.update(steps=step, clips=step * o.batch_size,
                  seconds=round(time.perf_counter() - budget.t0, 1), final_loss=st["final_loss"],
                  train=o.train, batch_size=o.batch_size, frames=o.frames,
                  lr=o.lr, kl_weight=o.kl_weight, fg_weight=o.fg_weight,
                  sample=o.sample)
    vae.eval().requires_grad_(False)


@torch.no_grad()
def posterior_means(vae, params: torch.Tensor, frames: int, size: int,
                    dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Render a batch of clip specifications on ``dev`` and encode them: the posterior means and
    the rendered object masks ``(B, T, H, W)``."""
    clips, fg = render_batch(params.to(dev), frames, size)
    with autocast(dev):
        return vae.encode(to_tensor(clips)).latent_dist.mode(), fg


def latent_object_mask(fg: torch.Tensor, latent_shape: tuple[int, ...]) -> torch.Tensor:
    """The latent cells ``(B, 1, T', H', W')`` whose pixels any object touches: a pixel mask
    ``(B, T, H, W)`` max-pooled the way the VAE compresses, the first frame alone and then
    groups of ``(T - 1) / (T' - 1)`` frames, ``H / H'`` x ``W / W'`` pixels."""
    t, h, w = latent_shape[-3:]
    b, frames = fg.shape[:2]
    first = fg[:, :1]
    rest = fg[:, 1:].reshape(b, t - 1, (frames - 1) // (t - 1), *fg.shape[2:]).any(2)
    m = torch.cat([first, rest], 1).float()
    return F.adaptive_max_pool2d(m, (h, w)).unsqueeze(1).bool()


@torch.no_grad()
def latent_stats(pipe, cfg: TinyTrainConfig, ctx: Context, state: dict) -> None:
    """Per-channel mean and std of the posterior means over ``--stats-clips`` clips, written into
    the VAE config (``latents_mean`` / ``latents_std``)."""
    r, o, dev = cfg.run, cfg.vae, ctx.dev
    vae = pipe.vae.to(dev).eval()
    batch = max(1, min(32, o.stats_clips))
    batches = spec_batches(r.seed * 1000 + STREAM_STATS, 0, batch, r.workers)
    total, total_sq, count, clips = None, None, 0, 0
    while clips < o.stats_clips:
        params, _ = next(batches)
        mu = posterior_means(vae, params, r.frames, r.size, dev)[0].double()
        s = mu.sum(dim=(0, 2, 3, 4))
        sq = mu.square().sum(dim=(0, 2, 3, 4))
        total = s if total is None else total + s
        total_sq = sq if total_sq is None else total_sq + sq
        count += mu.numel() // mu.shape[1]
        clips += mu.shape[0]
    batches.close()
    mean = total / count
    std = (total_sq / count - mean.square()).clamp_min(1e-12).sqrt()
    vae.register_to_config(latents_mean=[round(float(v), 6) for v in mean],
                           latents_std=[round(float(v), 6) for v in std])
    state["latent_stats_clips"] = clips
    log("latents: mean " + " ".join(f"{v:+.2f}" for v in mean.tolist()))
    log("latents: std  " + " ".join(f"{v:.2f}" for v in std.tolist()))

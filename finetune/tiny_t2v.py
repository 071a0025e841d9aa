"""Stage ``t2v`` of ``attnqat finetune tiny``: freeze the VAE and train the UMT5 text encoder and
the ``WanTransformer3DModel`` jointly with rectified-flow matching on normalized latents, drawn
from a pool of encoded synthetic clips that is refreshed as training goes."""

from __future__ import annotations

import time
from typing import Callable, Iterator

import torch

from attnqat.finetune.encode import latent_norm
from attnqat.finetune.objective import flow_matching_loss, noisy_input, predict, sample_sigma
from attnqat.finetune.schedule import lr_factor
from attnqat.finetune.tiny_config import STREAM_T2V, TEXT_SEQ_LEN, TinyTrainConfig
from attnqat.finetune.tiny_context import Budget, Context, autocast, log
from attnqat.finetune.tiny_models import averaged, ema_of
from attnqat.finetune.tiny_text import (TextBindingHead, encode_text, scale_text_attention,
                                        tokenize)
from attnqat.finetune.tiny_vae import latent_object_mask, posterior_means
from attnqat.synthetic import spec_batches


def flow_loss(transformer, text_encoder, z0: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor,
              generator: torch.Generator | None, shift: float,
              seq_len: int = TEXT_SEQ_LEN, text_aux: TextBindingHead | None = None,
              aux_weight: float = 0.0, aux_out: dict | None = None,
              weight: torch.Tensor | None = None) -> torch.Tensor:
    """Rectified-flow matching loss (:mod:`attnqat.finetune.objective`: uniform noise levels
    through the flow shift, then the noise, drawn from ``generator``) of one batch of normalized
    latents ``z0``, with the prompt embeddings computed differentiably by ``text_encoder``; with
    ``weight`` (broadcastable to ``z0``) a weighted mean; with ``text_aux``, plus ``aux_weight``
    times its binding loss (the parts go to ``aux_out``)."""
    sigma = sample_sigma(z0.shape[0], generator, sampling="uniform", shift=shift, device=z0.device)
    noise = torch.randn(z0.shape, generator=generator, device=z0.device)
    xt, timestep, target = noisy_input(z0, noise, sigma)
    emb = encode_text(text_encoder, ids, mask, seq_len)
    loss = flow_matching_loss(predict(transformer, xt, timestep, emb), target, weight)
    if text_aux is None:
        return loss
    aux, acc = text_aux(emb[:, :ids.shape[1]], ids)
    if aux_out is not None:
        aux_out.update(flow=loss.detach(), aux=aux.detach(), acc=acc.detach())
    return loss + aux_weight * aux


@torch.no_grad()
def encode_clips(vae, params: torch.Tensor, frames: int, size: int, mean: torch.Tensor,
                 std: torch.Tensor, dev: torch.device, object_mask: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Render, encode (posterior mean) and normalize a batch of clip specifications; with
    ``object_mask``, also the latent cells the objects touch (:func:`latent_object_mask`)."""
    z, fg = posterior_means(vae, params, frames, size, dev)
    return (z.float() - mean) / std, latent_object_mask(fg, z.shape) if object_mask else None


class LatentPool:
    """The latents trained on, on the device (bf16), with their captions' tokens: filled first,
    then a ring buffer refreshed with new clips (encoding is the expensive part of the data)."""

    def __init__(self, pipe, cfg: TinyTrainConfig, dev: torch.device) -> None:
        self.pipe, self.run, self.opts, self.dev = pipe, cfg.run, cfg.t2v, dev
        self.mean, self.std = latent_norm(pipe.vae, dev)
        size, length = self.opts.pool, self.opts.text_len
        self.z: torch.Tensor | None = None
        self.ids = torch.zeros(size, length, dtype=torch.long, device=dev)
        self.mask = torch.zeros_like(self.ids)
        self.fg: torch.Tensor | None = None   # latent cells the objects touch (--object-weight only)
        self.filled, self.ptr, self.clips_used = 0, 0, 0

    def add(self, batches: Iterator[tuple[torch.Tensor, list[str]]]) -> None:
        """Encode the next batch of the stream into the pool, replacing the oldest latents."""
        size = self.opts.pool
        params, captions = next(batches)
        z, fg = encode_clips(self.pipe.vae, params, self.run.frames, self.run.size, self.mean,
                             self.std, self.dev, object_mask=self.opts.object_weight > 0)
        ids, msk = tokenize(self.pipe.tokenizer, captions, self.opts.text_len)
        if self.z is None:
            self.z = torch.zeros((size, *z.shape[1:]), dtype=torch.bfloat16, device=self.dev)
            if fg is not None:
                self.fg = torch.zeros((size, *fg.shape[1:]), dtype=torch.bool, device=self.dev)
        p, n = self.ptr, min(z.shape[0], size - self.ptr)
        self.z[p:p + n] = z[:n].to(torch.bfloat16)
        if fg is not None:
            self.fg[p:p + n] = fg[:n]
        self.ids[p:p + n], self.mask[p:p + n] = ids[:n].to(self.dev), msk[:n].to(self.dev)
        self.ptr = (p + n) % size
        self.filled = min(size, self.filled + n)
        self.clips_used += n

    def draw(self, generator: torch.Generator):
        """A training batch drawn at random: latents (float32), weights (or None), ids, mask."""
        idx = torch.randint(self.filled, (self.opts.batch_size,), generator=generator,
                            device=self.dev)
        weight = None if self.fg is None else 1.0 + self.opts.object_weight * self.fg[idx].float()
        return self.z[idx].float(), weight, self.ids[idx], self.mask[idx]


def _param_groups(modules: list[torch.nn.Module], weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for m in modules:
        for p in m.parameters():
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def _trainees(pipe, cfg: TinyTrainConfig, dev: torch.device):
    """The VAE frozen; the text encoder and transformer (and the text-binding head) in training
    mode on ``dev``, their EMA and their optimizer."""
    o = cfg.t2v
    pipe.vae.to(dev).eval().requires_grad_(False)
    te = pipe.text_encoder.to(dev).train().requires_grad_(True)
    tr = pipe.transformer.to(dev).train().requires_grad_(True)
    if o.text_attn_scale != 1.0:
        scale_text_attention(te, o.text_attn_scale)
        log(f"t2v: text encoder attention logits scaled by {o.text_attn_scale}")
    head = TextBindingHead(pipe.tokenizer, te.config.d_model).to(dev) if o.text_aux > 0 else None
    ema = ema_of([te, tr], o.ema) if o.ema > 0 else None
    trained = [te, tr] + ([head] if head is not None else [])
    opt = torch.optim.AdamW(_param_groups(trained, o.weight_decay), lr=o.lr,
                            betas=(0.9, 0.99), eps=1e-8)
    return te, tr, head, ema, trained, opt


def _fill(pool: LatentPool, cfg: TinyTrainConfig, start: int):
    """Fill the pool from item ``start`` of the stream; the refresh batches that follow (None
    without ``--fresh``)."""
    o, seed = cfg.t2v, cfg.run.seed * 1000 + STREAM_T2V
    weights = None if o.two_objects is None else (1.0 - o.two_objects, o.two_objects)
    t_fill = time.perf_counter()
    fill = spec_batches(seed, start, max(1, min(o.fill_batch, o.pool)), cfg.run.workers, weights)
    while pool.filled < o.pool:
        pool.add(fill)
    fill.close()
    if pool.dev.type == "cuda":
        torch.cuda.synchronize(pool.dev)
    t_fill = time.perf_counter() - t_fill
    te, tr = pool.pipe.text_encoder, pool.pipe.transformer
    log(f"t2v: pool of {pool.filled} latents {tuple(pool.z.shape[1:])} filled in {t_fill:.1f} s "
        f"({pool.filled / max(t_fill, 1e-9):.0f} clips/s); transformer "
        f"{sum(p.numel() for p in tr.parameters()) / 1e6:.2f} M, text encoder "
        f"{sum(p.numel() for p in te.parameters()) / 1e6:.2f} M parameters")
    fresh = max(0, o.fresh)
    return (spec_batches(seed, start + pool.clips_used, fresh, cfg.run.workers, weights)
            if fresh else None)


def train_t2v(pipe, cfg: TinyTrainConfig, ctx: Context, state: dict,
              save: Callable[[list[torch.nn.Module]], None], record: dict) -> list[torch.nn.Module]:
    """Train; returns the modules to save (the EMA copies, or the live ones without EMA). Totals
    go to ``state["t2v"]``, this run's settings and counts to ``record``."""
    r, o, dev = cfg.run, cfg.t2v, ctx.dev
    st = state.setdefault("t2v", {"steps": 0, "samples": 0, "clips": 0, "seconds": 0.0})
    te, tr, head, ema, trained, opt = _trainees(pipe, cfg, dev)
    gen = torch.Generator(dev).manual_seed(r.seed * 7 + 2 + 1000 * len(state.get("runs", [])))
    empty_ids, empty_mask = (t.to(dev) for t in tokenize(pipe.tokenizer, [""], o.text_len))
    pool = LatentPool(pipe, cfg, dev)
    batches = _fill(pool, cfg, st["clips"])
    compiled = o.compile
    if compiled:
        tr.compile()   # in place: the parameters (which the EMA follows) stay the same
    budget = Budget(o.steps, o.minutes, ctx.clock)
    log(f"t2v: batch {o.batch_size}, {max(0, o.fresh)} fresh clips every {o.fresh_every} steps, "
        f"budget {o.steps or '-'} steps / {budget.seconds / 60:.1f} min")
    params_all = [p for m in trained for p in m.parameters()]
    step, t_data, loss_sum, loss_n = 0, 0.0, 0.0, 0
    aux_out: dict = {}
    t_last = t_saved = time.perf_counter()
    loss = torch.zeros(())

    def account() -> None:
        _t2v_account(st, record, step, cfg, ctx, pool.clips_used, budget, loss.item(), compiled)

    while not budget.done(step):
        t_d = time.perf_counter()
        if batches is not None and step % max(1, o.fresh_every) == 0:
            pool.add(batches)
        t_data += time.perf_counter() - t_d
        z0, weight, ids, msk = pool.draw(gen)
        drop = torch.rand(o.batch_size, generator=gen, device=dev) < o.caption_dropout
        ids = torch.where(drop[:, None], empty_ids, ids)
        msk = torch.where(drop[:, None], empty_mask, msk)
        for g in opt.param_groups:
            g["lr"] = o.lr * lr_factor(step, budget.progress(step), warmup=o.warmup,
                                       schedule="linear_tail", decay_frac=o.decay_frac,
                                       final=o.final_lr_frac)
        try:
            with autocast(dev):
                loss = flow_loss(tr, te, z0, ids, msk, gen, o.shift, ctx.seq_len, head,
                                 o.text_aux, aux_out, weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
        except Exception as e:   # only the compilation may fail, at the first step
            if not (compiled and step == 0):
                raise
            log(f"WARNING: torch.compile of the transformer failed ({type(e).__name__}: "
                f"{str(e)[:300]}); training this run eagerly (same numerics, slower)")
            tr._compiled_call_impl = None
            compiled = False
            continue
        gnorm = torch.nn.utils.clip_grad_norm_(params_all, 1.0)
        opt.step()
        if ema is not None:
            ema.update()
        step += 1
        loss_sum, loss_n = loss_sum + loss.detach(), loss_n + 1
        if step % r.log_every == 0 or step == 1:
            dt = time.perf_counter() - t_last
            _log_t2v(ctx, st["steps"] + step, float(loss_sum) / loss_n, float(gnorm),
                     opt.param_groups[0]["lr"], loss_n / dt, 100 * t_data / dt, aux_out)
            t_last, t_data, loss_sum, loss_n = time.perf_counter(), 0.0, 0.0, 0
        if r.save_every_minutes > 0 and time.perf_counter() - t_saved > 60 * r.save_every_minutes:
            before = dict(st)   # the save carries this run so far; training goes on from before
            account()
            save(averaged([te, tr], ema))
            st.clear()
            st.update(before)
            t_saved = time.perf_counter()
    if batches is not None:
        batches.close()
    account()
    te.eval().requires_grad_(False)
    tr.eval().requires_grad_(False)
    return averaged([te, tr], ema)


def _log_t2v(ctx: Context, step: int, loss: float, gnorm: float, lr: float, its: float,
             data_pct: float, aux_out: dict) -> None:
    """One progress record (run log) and console line of the t2v stage."""
    if ctx.runlog is not None:
        ctx.runlog.write(step, "train", loss=loss, grad_norm=gnorm, lr=lr, steps_per_s=its,
                         **({k: float(v) for k, v in aux_out.items()} if aux_out else {}))
    log(f"t2v step {step:6d}  loss {loss:.4f}  gnorm {gnorm:.2f}  lr {lr:.2e}  "
        f"{its:.1f} it/s  data {data_pct:.0f}%  t {ctx.clock.elapsed():.0f}s"
        + (f"  (last step: flow {float(aux_out['flow']):.4f}, binding loss "
           f"{float(aux_out['aux']):.3f}, accuracy {float(aux_out['acc']):.2f})" if aux_out else ""))


def _t2v_account(st: dict, record: dict, step: int, cfg: TinyTrainConfig, ctx: Context,
                 clips: int, budget: Budget, loss: float, compiled: bool) -> None:
    o = cfg.t2v
    seconds = time.perf_counter() - budget.t0
    st["steps"] += step
    st["samples"] += step * o.batch_size
    st["clips"] += clips
    st["seconds"] += seconds
    st["final_loss"] = loss
    record.update(steps=step, samples=step * o.batch_size, clips=clips,
                  seconds=round(seconds, 1), final_loss=loss, batch_size=o.batch_size,
                  lr=o.lr, warmup=o.warmup, decay_frac=o.decay_frac, ema=o.ema,
                  shift=o.shift, caption_dropout=o.caption_dropout, pool=o.pool,
                  fresh=o.fresh, fresh_every=o.fresh_every, text_len=o.text_len,
                  seq_len=ctx.seq_len, two_objects=o.two_objects,
                  grow_layers=o.grow_layers or None, compile=compiled,
                  text_aux=o.text_aux, text_attn_scale=o.text_attn_scale,
                  object_weight=o.object_weight)

"""Reference numbers, not part of stapo: the device check's rollout and update rows through
PyTorch and transformers on the same device, for the roofline columns of
scripts/device_check.sh (which runs it where python3 imports torch and transformers).

    python3 docs/bench/torch_device.py --what rollout --shape 0.6b --rows 256 --prompt 128 --new 256
    python3 docs/bench/torch_device.py --what update --shape 1.7b --batch 8 --seq 8192 --peak-tflops 989

Random weights at the Qwen3 shape, bf16, tied embeddings, the default (sdpa) attention.
rollout: `generate` of --rows rows, --new tokens each (EOS suppressed), T = 1 sampling;
tokens/s counts the new tokens, prefill included in the time. Its bandwidth bound is the
one of `model::budget::decode_step_bytes`: each step reads every weight once (the
embedding table as the head) and every row's keys and values up to its position; the
fraction is those bytes over the time over the bandwidth of a device-to-device copy of
1 GiB (read + write). update: one AdamW step of cross-entropy over --batch x --seq
random tokens, a row at a time (gradients accumulated), gradient checkpointing on, after
one untimed step; MFU = model FLOPs (`model::budget::update_flops_per_token`:
6 N + 6 layers Hq D (seq + 1) per token) x tokens/s over --peak-tflops.
"""
import argparse
import time

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

SHAPES = {
    "tiny": dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, intermediate_size=96, vocab_size=97),
    "0.6b": dict(num_hidden_layers=28, hidden_size=1024, num_attention_heads=16, num_key_value_heads=8,
                 head_dim=128, intermediate_size=3072, vocab_size=151936),
    "1.7b": dict(num_hidden_layers=28, hidden_size=2048, num_attention_heads=16, num_key_value_heads=8,
                 head_dim=128, intermediate_size=6144, vocab_size=151936),
}


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(device, n=1 << 28):
    """Bytes/s of a device-to-device copy of n f32 values (read + write), best of 5."""
    src = torch.zeros(n, dtype=torch.float32, device=device)
    best = float("inf")
    for i in range(6):
        sync(device)
        t0 = time.perf_counter()
        dst = src.clone()
        sync(device)
        if i > 0:
            best = min(best, time.perf_counter() - t0)
        del dst
    return 2 * 4 * n / best


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--what", choices=["rollout", "update"], required=True)
    p.add_argument("--shape", choices=sorted(SHAPES), default="0.6b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--peak-tflops", type=float, default=0.0)
    p.add_argument("--copy-values", type=int, default=1 << 28)
    a = p.parse_args()
    device = torch.device(a.device)
    s = SHAPES[a.shape]
    cfg = Qwen3Config(**s, tie_word_embeddings=True, max_position_embeddings=40960, rope_theta=1e6,
                      torch_dtype="bfloat16")
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg).to(device=device, dtype=torch.bfloat16)
    params = sum(t.numel() for t in model.parameters())  # tied table counted once
    L, h, hq, hkv, d = (s["num_hidden_layers"], s["hidden_size"], s["num_attention_heads"],
                        s["num_key_value_heads"], s["head_dim"])
    if a.what == "rollout":
        bw = copy_bandwidth(device, a.copy_values)
        model.eval()
        ids = torch.randint(0, s["vocab_size"], (a.rows, a.prompt), device=device)
        kw = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=a.new,
                  min_new_tokens=a.new, pad_token_id=0, eos_token_id=None)
        with torch.no_grad():
            mask = torch.ones_like(ids)
            warm = dict(kw, max_new_tokens=4, min_new_tokens=4)
            model.generate(ids[:, :8], attention_mask=mask[:, :8], **warm)  # warm-up
            sync(device)
            t0 = time.perf_counter()
            model.generate(ids, attention_mask=mask, **kw)
            sync(device)
            secs = time.perf_counter() - t0
        kv_per_token = 2 * L * hkv * d * 2
        # Step j (1..new) reads the weights, rows embedding rows and rows x (prompt + j) tokens' K and V.
        weights = a.new * (params + a.rows * h) * 2
        kv = a.rows * sum(a.prompt + j for j in range(1, a.new + 1)) * kv_per_token
        frac = (weights + kv) / secs / bw
        print(f"torch rollout {a.shape}: {a.rows} rows x {a.prompt} + {a.new}: "
              f"{a.rows * a.new / secs:.0f} tok/s, {secs:.2f} s, {(weights + kv) / a.new / 1e6:.1f} MB read "
              f"per step, {100 * frac:.1f}% of the bandwidth bound ({bw / 1e9:.0f} GB/s copy)")
    else:
        model.train()
        model.gradient_checkpointing_enable()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
        ids = torch.randint(0, s["vocab_size"], (a.batch, a.seq), device=device)

        def step():
            opt.zero_grad(set_to_none=True)
            for r in range(a.batch):
                out = model(input_ids=ids[r:r + 1], labels=ids[r:r + 1])
                (out.loss / a.batch).backward()
            opt.step()

        step()
        sync(device)
        t0 = time.perf_counter()
        step()
        sync(device)
        secs = time.perf_counter() - t0
        tps = a.batch * a.seq / secs
        n = params - L * (2 * h + 2 * d) - h  # the weights a token multiplies
        flops = 6 * n + 6 * L * hq * d * (a.seq + 1)
        mfu = f"MFU {100 * flops * tps / (a.peak_tflops * 1e12):.1f}%" if a.peak_tflops > 0 else "MFU unknown"
        print(f"torch update {a.shape}: {a.batch} x {a.seq} tokens: {tps:.0f} tok/s, {secs:.2f} s, "
              f"{flops * tps / 1e12:.2f} TFLOP/s, {mfu}")


if __name__ == "__main__":
    main()

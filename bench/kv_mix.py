#!/usr/bin/env python3
"""Writes a synthetic trace of a decoding loop whose KV tensors sit a little above multiples of
the 2 MiB page, for `moonbright replay` (issue 48's pattern: rounding waste).

What it models: Hugging Face `generate` with a `DynamicCache`, batch x beams sequences, each
layer's K and V a `[sequences, kv_heads, tokens, head_dim]` bf16 tensor that `torch.cat` makes
anew at every token (the new one allocated before the old one is freed), beside each step's
activations (hidden states, attention scores, the MLP's intermediate, logits), all freed by the
end of the step. Between requests (`--requests`) the batch size changes and the cache starts
over, so the KV sizes walk through many page remainders: the live KV tensors are many, large,
and each rounded up to whole pages wastes up to a page.

    python3 bench/kv_mix.py kv_mix.csv.gz
    moonbright replay --backend host kv_mix.csv.gz
    python3 bench/rounding_floor.py kv_mix.csv.gz      # the least whole pages can hold

Output is our CSV (`seq,action,addr,size,stream,dt_us`), gzipped when the name ends in `.gz`.
"""

import argparse
import gzip
import random

MIB = 1 << 20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    # A TinyLlama-sized model (1.1B): 22 layers, 4 KV heads of 64.
    ap.add_argument("--layers", type=int, default=22)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--with-weights", action="store_true",
                    help="allocate the weights in the trace too (by default they are not: a "
                         "model loaded before the allocator took over, and the cache dominates)")
    ap.add_argument("--seed", type=int, default=20261206)
    args = ap.parse_args()

    rng = random.Random(args.seed)
    rows: list[tuple[str, int, int]] = []
    next_addr = 1 << 40

    def alloc(size: int) -> int:
        nonlocal next_addr
        addr = next_addr
        next_addr += (size + 511) // 512 * 512
        rows.append(("alloc", addr, size))
        return addr

    def free(addr: int, size: int) -> None:
        rows.append(("free_completed", addr, size))

    # The weights, if in the trace, stay live throughout: a tensor for each layer's attention and
    # MLP projections, and the embedding.
    h, kvh, d = args.hidden, args.kv_heads, args.head_dim
    weight_sizes = [2 * h * (2 * h + 2 * kvh * d)] * args.layers + [2 * h * 3 * 4 * h] * args.layers
    weight_sizes.append(2 * args.vocab * h)
    weights = [(alloc(size), size) for size in weight_sizes] if args.with_weights else []
    for _ in range(args.requests):
        # Odd numbers of sequences (batch x beams), as a server's batches come.
        seqs = rng.choice([5, 7, 9, 11, 13]) * rng.choice([1, 2, 4])
        tokens = args.prompt + rng.randrange(-40, 41)
        kv_row = 2 * seqs * kvh * d  # bytes per token of one layer's K (or V)
        cache = [[alloc(kv_row * tokens), alloc(kv_row * tokens)] for _ in range(args.layers)]
        sizes = [[kv_row * tokens, kv_row * tokens] for _ in range(args.layers)]
        for _ in range(args.new_tokens):
            step: list[tuple[int, int]] = []
            hidden = 2 * seqs * h
            step.append((alloc(hidden), hidden))
            for layer in range(args.layers):
                for kv in range(2):
                    new = sizes[layer][kv] + kv_row
                    addr = alloc(new)
                    free(cache[layer][kv], sizes[layer][kv])
                    cache[layer][kv], sizes[layer][kv] = addr, new
                # One token's attention scores over the cache, and the MLP's intermediate.
                scores = 4 * seqs * args.heads * (tokens + 1)
                a = alloc(scores)
                m = alloc(2 * seqs * 4 * h)
                free(a, scores)
                free(m, 2 * seqs * 4 * h)
            logits = 4 * seqs * args.vocab
            step.append((alloc(logits), logits))
            for addr, size in step:
                free(addr, size)
            tokens += 1
        for layer in range(args.layers):
            for kv in range(2):
                free(cache[layer][kv], sizes[layer][kv])
    for addr, size in weights:
        free(addr, size)

    opener = gzip.open if args.out.endswith(".gz") else open
    with opener(args.out, "wt") as f:
        f.write("seq,action,addr,size,stream,dt_us\n")
        for i, (action, addr, size) in enumerate(rows):
            f.write(f"{i},{action},{addr},{size},0,\n")
    allocs = sum(1 for r in rows if r[0] == "alloc")
    print(f"{args.out}: {allocs} allocations, {len(rows)} events")


if __name__ == "__main__":
    main()

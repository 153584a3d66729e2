"""Closed-loop chat load against an OpenAI-compatible URL, counting errors.

    python scripts/chat-load.py URL MODEL REQUESTS CONCURRENCY [MAX_TOKENS]

CONCURRENCY clients each send their next chat request as soon as the last
one is answered, REQUESTS in all, over keep-alive connections (httpx, as
the `openai` client uses). Prints one line: requests, errors by status or
exception, requests/s and latency p50/p99. Used for issue 20's connection
robustness figures against llama.cpp's server behind `hangar serve`
(docs/engines.md); needs httpx (in crates/hangar/tests/python-requirements.txt
through `openai`).
"""

import asyncio
import collections
import sys
import time

import httpx


async def main(url, model, requests, concurrency, max_tokens):
    body = {"model": model, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": "Name a colour."}]}
    errors = collections.Counter()
    latencies = []
    left = iter(range(requests))
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=120) as client:
        async def worker():
            for _ in left:
                t = time.perf_counter()
                try:
                    r = await client.post("/v1/chat/completions", json=body)
                    if r.status_code != 200:
                        errors[f"{r.status_code} {r.text[:80]}"] += 1
                except httpx.HTTPError as e:
                    errors[type(e).__name__] += 1
                latencies.append(time.perf_counter() - t)
        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        took = time.perf_counter() - start
    latencies.sort()
    pct = lambda p: latencies[min(len(latencies) - 1, int(p * len(latencies)))] * 1e3
    print(f"concurrency {concurrency}: {requests} requests, {sum(errors.values())} errors {dict(errors)}, "
          f"{requests / took:.1f} req/s, p50 {pct(0.5):.0f} ms, p99 {pct(0.99):.0f} ms")


if __name__ == "__main__":
    url, model, n, c = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    asyncio.run(main(url, model, n, c, int(sys.argv[5]) if len(sys.argv) > 5 else 4))

"""``kvserve serve`` of a model with sliding and global layers, as the README serves one
(``--kv-store host://``): the engine runs the hybrid KV layout, says so in its start log,
and the official ``openai`` client gets the same text on a repeat that the prefix cache
and the host tier serve."""

from __future__ import annotations

import openai

from kvserve.testing.procs import running_server


def test_served_gemma3_runs_hybrid_with_the_kv_store(model_dirs, tmp_path):
    model = model_dirs["gemma3"]
    log = tmp_path / "server.log"
    args = ("--kv-store", "host://?capacity=64MiB", "--max-model-len", "256")
    with running_server(model, *args, log=log) as srv:
        assert "hybrid: 2 groups of 1 layers, 1 global, 1 sliding over 12" in log.read_text()
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
        prompt = " ".join(f"word{i % 23}" for i in range(40))  # many 12-token windows
        first = client.completions.create(
            model=str(model), prompt=prompt, max_tokens=20, temperature=0, timeout=60
        )
        again = client.completions.create(
            model=str(model), prompt=prompt, max_tokens=20, temperature=0, timeout=60
        )
        assert first.choices[0].text == again.choices[0].text
        assert first.usage.completion_tokens == 20
        details = again.usage.prompt_tokens_details
        assert details is not None and details.cached_tokens >= 16  # shared whole blocks

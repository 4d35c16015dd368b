"""Backends answer the controller's request batches (spec/architecture.md "The shape").

- `backends.live`: real models behind OpenAI-compatible servers (vLLM), with `backends.cache`
  (the on-disk response cache) and `meshheal_jax.prompts` (prompt text and reply parsing).
  Needs the optional `live` extra (openai, httpx, pydantic): `pip install -e .[live]`.

Nothing is imported here, so `import meshheal_jax.backends` costs nothing and needs no extra.
"""

"""`zlm serve`: a local HTTP server for one model, with continuous batching and a playground.

    engine.py       the scheduler task, the model thread, slots (continuous batching)
    batch.py        the rows of one batch: prefill, joining and leaving, the batched step
    app.py          the Starlette app: routes, errors, auth, streaming, disconnects
    params.py       request fields, checked one by one (422 naming the field)
    completions.py  POST /v1/completions in OpenAI's format
    page.py         the playground page at /

The command is cli/serve.py; docs/serve.md describes the API and its measurements.
"""

"""The OpenAI-compatible server's parts (the command itself is roseinfer/cli/serve.py).

* protocol.py: what a request may hold (pydantic models);
* errors.py: every error in OpenAI's JSON shape, with its status;
* auth.py: the API key, a dependency of every route;
* connections.py: bounds below HTTP (how long a request head may take to arrive, how
  many connections are held) and one log line, not a flood, when file descriptors run out;
* limits.py: the bound on a request body (plain ASGI, in front of everything);
* checks.py: a request's fields checked against this server, as the engine's jobs;
* engine_thread.py: the one thread that owns the engine, and the asyncio side that
  hands it requests and receives their outputs;
* handling.py: running a request through the engine thread and answering it (JSON or
  server-sent events), also when its client leaves or the engine fails it;
* responses.py: engine outputs -> OpenAI's response and chunk dicts;
* metrics.py: the Prometheus registry behind GET /metrics;
* chat_template.py: messages -> prompt text (GPT-2 has no chat format of its own),
  sandboxed, checked at startup, rendered off the event loop under a time limit;
* live.py: the live page at / and the engine's snapshots it draws, its watchers capped;
* background.py: a server on a thread of this process, for notebooks and scripts;
* app.py: the FastAPI application and its endpoints.
"""

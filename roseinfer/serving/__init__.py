"""The OpenAI-compatible server's parts (the command itself is roseinfer/cli/serve.py).

* protocol.py: what a request may hold (pydantic models) and OpenAI's error shape;
* engine_thread.py: the one thread that owns the engine, and the asyncio side that
  hands it requests and receives their outputs;
* metrics.py: the Prometheus registry behind GET /metrics;
* chat_template.py: messages -> prompt text (GPT-2 has no chat format of its own);
* app.py: the FastAPI application and its endpoints.
"""

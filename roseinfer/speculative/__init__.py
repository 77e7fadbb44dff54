"""Speculative decoding: cheap drafts, verified by the target in one pass.

A drafter (`drafters.py`: another model, prompt lookup, or the target's own first
layers) proposes the next k tokens; the target reads the last accepted token and the k
drafts in one call (k + 1 queries over its cache) and keeps the longest run it agrees
with, plus one token of its own (`verify.py`). The teaching loop
(roseinfer/loops/speculative.py) and the engine (roseinfer/engine/llm_engine.py) both
take a `Drafter` and call the one `verify_drafts`.
"""

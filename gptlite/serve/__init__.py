"""An OpenAI-compatible HTTP server with continuous batching and a chat page (`python -m gptlite.serve`).

rows.py        RowCache: one preallocated KV cache whose rows each hold a request, at its own length (the
               model reads it as it reads sample.py's cache: gptlite.inference.kvcache.AttentionCache)
engine.py      Engine: continuous batching on a background thread, no HTTP
protocol.py    the OpenAI request bodies (checked, their parsing bounded) and response shapes
policy.py      the rules for clients the command reads from its options (no web framework imported)
guard.py       who may use the server and how much a request may send: host names, the API key, body size and
               time, Content-Type, checked before any route reads a request
app.py         the FastAPI app: /v1/models, /v1/completions, /v1/chat/completions, the page at /
connection.py  the HTTP connection under it: uvicorn's h11 protocol with a deadline for headers, JSON 400s and
               a shutdown no client can hold
chat.html      the chat page, one file, no build step and nothing fetched from elsewhere
__main__.py    the command: load a model, start the engine, serve it with uvicorn until a signal or the engine stops
"""

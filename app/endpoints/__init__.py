"""OpenAI-compatible servers as models of the workbench: vLLM, SGLang, llama.cpp's server,
Ollama, LM Studio, or ``infersight serve`` on another machine (issue 52).

:mod:`app.endpoints.client` speaks to one over HTTP (``/v1/models``, streamed chat
completions with the client's own clock on every chunk) and turns each way a server fails a
user into one line (:class:`~app.endpoints.client.EndpointError`); API keys are kept in the
OS keyring (:mod:`app.endpoints.keys`). No Qt and no torch here: the app's worker, the A/B
lab and the tuner call it from their own threads.
"""

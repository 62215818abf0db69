"""The OpenAI-compatible server: ``protocol`` (request/response bodies), ``serving_*`` (the
endpoints), ``api_server`` (the app), ``cli`` (``pagedllm serve``)."""

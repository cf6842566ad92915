"""megarl's embedded rollout engine: an HF model behind SGLang's HTTP API.

``model_runner`` runs the model on a left-padded batched KV cache, ``sampling`` draws tokens and
their log-probs, ``engine`` schedules requests with continuous batching, ``weights`` and
``weight_updates`` receive new weights in place, ``server`` serves it all over HTTP.
"""

"""The HTTP API (OpenAI-compatible routes plus ``/v1/walks/{walk}``) over a running ``Server``:
``create_app(server, profile, ApiConfig(...))``. See ``api.app``."""

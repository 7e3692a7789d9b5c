"""The HTTP routes, one module per route family, each an ``APIRouter`` whose handlers read the
shared ``ApiContext`` (``api.context.context(request)``):

    ops      GET /health, GET /v1/models, GET /metrics
    text     POST /v1/completions (and the text generation that chat shares)
    chat     POST /v1/chat/completions (text, tools, structured output, audio output)
    speech   POST /v1/audio/speech
    transcriptions  POST /v1/audio/transcriptions
    images   POST /v1/images/generations, POST /v1/images/edits
    walks    POST /v1/walks/{walk}
"""

from walkserve.api.routes import chat, images, ops, speech, text, transcriptions, walks

ROUTERS = (
    ops.router,
    text.router,
    chat.router,
    speech.router,
    transcriptions.router,
    images.router,
    walks.router,
)

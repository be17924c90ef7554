"""Tool calling on ``/v1/chat/completions``: the request's tools (``spec``), how they reach
the prompt (``prompt``), and how calls are read out of the output (``parsers``,
``json_scan``) and streamed (``stream``)."""

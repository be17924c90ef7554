"""The OpenAI Responses API: request bodies, stored responses, events, routes."""

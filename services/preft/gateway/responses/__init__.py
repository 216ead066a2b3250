"""OpenAI's Responses API over the chat service: stored responses, conversations, background runs."""

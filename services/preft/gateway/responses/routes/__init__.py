"""The Responses and Conversations routes."""

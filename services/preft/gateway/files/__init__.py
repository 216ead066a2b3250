"""OpenAI's Files API: contents in S3, metadata in Redis, expired files swept; and the batch input format checked
at upload."""

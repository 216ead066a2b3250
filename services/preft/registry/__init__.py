"""The adapter registry: blobs in S3 (content-addressed), metadata in Redis, served over gRPC."""

"""OpenAI's Batch API: batches run by any replica under a lease, their lines answered by the generation services
as offline work, recorded in parts."""

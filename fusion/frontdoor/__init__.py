"""The one front door every caller goes through (`FusionService`): a request admitted once, its text
streamed as events; prompt formatting and detokenisation at this edge."""

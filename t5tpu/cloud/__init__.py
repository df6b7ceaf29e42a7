"""Descriptions of cloud jobs (Vertex AI), built without any network."""

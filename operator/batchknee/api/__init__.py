"""The LLMServing API: pydantic models of the CRD, and the CRD generated from them."""

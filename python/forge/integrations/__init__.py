"""forge.integrations — forge.optim inside other libraries' training loops (hf.py: Hugging Face
transformers' Trainer). Each module imports its library only when used."""

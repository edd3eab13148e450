"""The primitive training API: sessions, LoRA training clients on resident base models, sampling sessions, and requests as futures."""

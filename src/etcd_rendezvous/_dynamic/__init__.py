"""The dynamic rendezvous' internals: state, decisions, executor and admission."""

"""hivemind"""

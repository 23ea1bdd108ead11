"""Approvals: the policy (pure decisions), the approver (state per event, hooks, the POST) and hooks."""

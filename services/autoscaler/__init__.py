"""The autoscaler: worker and gateway metrics -> demand forecast -> desired prefill and decode
replicas -> an actuator (Kubernetes Deployments or local worker processes). Imports no torch
except `profiler`, which measures a HardwareProfile on this machine."""

"""Admission: who may send what (tenants, quotas, local or shared in Redis) and when a request may
go to the workers (fair queue, cluster capacity, TTFT prediction with early rejection)."""

-- Argo CD health check for batchpilot.dev/BatchingPolicy
-- (argocd-cm: resource.customizations.health.batchpilot.dev_BatchingPolicy).
-- Reads only .status, written by the operator; honours observedGeneration so a freshly
-- synced spec is never reported Healthy on the previous generation's status.
local hs = {}
local function message_of(status, fallback)
  if status.message ~= nil and status.message ~= "" then
    return status.message
  end
  return fallback
end
if obj.status == nil or obj.status.phase == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to reconcile the policy"
  return hs
end
local status = obj.status
local generation = obj.metadata.generation
if generation ~= nil and (status.observedGeneration == nil or status.observedGeneration < generation) then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to observe generation " .. tostring(generation)
  return hs
end
local phase = status.phase
if phase == "Healthy" then
  hs.status = "Healthy"
  hs.message = message_of(status, "revision is stable")
elseif phase == "Paused" then
  hs.status = "Suspended"
  hs.message = message_of(status, "rollout paused")
elseif phase == "RolledBack" or phase == "Degraded" then
  hs.status = "Degraded"
  hs.message = message_of(status, phase)
else
  -- Pending (first revision rolling out) and Progressing (a canary runs, including a
  -- Stalled one: it holds, it is not failed; the message says why).
  hs.status = "Progressing"
  hs.message = message_of(status, phase)
end
return hs

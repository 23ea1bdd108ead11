#!/usr/bin/env bash
# forewarn fleet: what deploy/azure/fleet.json deploys, with the az CLI, for one subscription.
#   SUBSCRIPTION_ID=... STORAGE_ACCOUNT=... PRINCIPAL_ID=... deploy/azure/fleet-setup.sh
# Optional: RESOURCE_GROUP (forewarn-fleet), LOCATION (westeurope), QUEUE (scheduled-events),
# SYSTEM_TOPIC (forewarn-maintenance-resources), ASSIGN_SCHEDULED_EVENTS_CONTRIBUTOR=1 (only for acknowledging
# events, which forewarn fleet does with a policy). PRINCIPAL_ID is the object id of forewarn's managed identity.
# Nothing secret is read or printed: forewarn reads the queue with its identity (Workload Identity).
set -euo pipefail

: "${SUBSCRIPTION_ID:?set SUBSCRIPTION_ID to the subscription whose VMs forewarn watches}"
: "${STORAGE_ACCOUNT:?set STORAGE_ACCOUNT to a new Storage account name (3-24 lower-case letters and digits)}"
: "${PRINCIPAL_ID:?set PRINCIPAL_ID to the object id of the managed identity forewarn runs as}"
RESOURCE_GROUP="${RESOURCE_GROUP:-forewarn-fleet}"
LOCATION="${LOCATION:-westeurope}"
QUEUE="${QUEUE:-scheduled-events}"
POISON_QUEUE="${QUEUE}-poison"
SYSTEM_TOPIC="${SYSTEM_TOPIC:-forewarn-maintenance-resources}"

# Built-in role definition ids (deploy/azure/README.md says where each was looked up).
READER=acdd72a7-3385-48ef-bd42-f606fba81ae7
QUEUE_MESSAGE_PROCESSOR=8a0f0c08-91a1-4084-bc3d-661d67233fed
QUEUE_MESSAGE_SENDER=c6a89b2d-59bc-44d0-9896-0f6e12d7b80a
SCHEDULED_EVENTS_CONTRIBUTOR=b67fe603-310e-4889-b9ee-8257d09d353d

az account set --subscription "$SUBSCRIPTION_ID"
az group create --name "$RESOURCE_GROUP" --location "$LOCATION" --output none

az storage account create --name "$STORAGE_ACCOUNT" --resource-group "$RESOURCE_GROUP" --location "$LOCATION" \
  --kind StorageV2 --sku Standard_LRS --min-tls-version TLS1_2 --https-only true \
  --allow-blob-public-access false --output none
account_id=$(az storage account show --name "$STORAGE_ACCOUNT" --resource-group "$RESOURCE_GROUP" --query id --output tsv)
# The queues through the management plane (as fleet.json does): no account key or data-plane role is needed here.
for queue in "$QUEUE" "$POISON_QUEUE"; do
  az rest --method put --output none --body '{}' \
    --url "https://management.azure.com${account_id}/queueServices/default/queues/${queue}?api-version=2023-05-01"
done

# Scheduled Events of this subscription's VMs (preview; opt-in per VM, scale set or availability set).
az eventgrid system-topic create --name "$SYSTEM_TOPIC" --resource-group "$RESOURCE_GROUP" --location global \
  --topic-type microsoft.resourcenotifications.maintenanceresources --source "/subscriptions/$SUBSCRIPTION_ID" \
  --output none
# No event type filter on purpose: the documented type strings disagree; forewarn recognises events by their data.
az eventgrid system-topic event-subscription create --name forewarn-queue --resource-group "$RESOURCE_GROUP" \
  --system-topic-name "$SYSTEM_TOPIC" --endpoint-type storagequeue \
  --endpoint "${account_id}/queueservices/default/queues/${QUEUE}" --storage-queue-msg-ttl 604800 \
  --event-delivery-schema eventgridschema --max-delivery-attempts 30 --event-ttl 1440 --output none

assign() {  # role id, scope
  az role assignment create --assignee-object-id "$PRINCIPAL_ID" --assignee-principal-type ServicePrincipal \
    --role "$1" --scope "$2" --output none
}
assign "$READER" "/subscriptions/$SUBSCRIPTION_ID"
assign "$QUEUE_MESSAGE_PROCESSOR" "${account_id}/queueServices/default/queues/${QUEUE}"
assign "$QUEUE_MESSAGE_SENDER" "${account_id}/queueServices/default/queues/${POISON_QUEUE}"
if [ "${ASSIGN_SCHEDULED_EVENTS_CONTRIBUTOR:-0}" = 1 ]; then
  assign "$SCHEDULED_EVENTS_CONTRIBUTOR" "/subscriptions/$SUBSCRIPTION_ID"
fi

queue_url="$(az storage account show --name "$STORAGE_ACCOUNT" --resource-group "$RESOURCE_GROUP" \
  --query primaryEndpoints.queue --output tsv)${QUEUE}"
echo "queue: $queue_url (fleet.queue.url in the Helm values, FOREWARN_QUEUE_URL in the kustomize overlay)"

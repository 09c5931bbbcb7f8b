{{/* Names and labels. */}}
{{- define "baton.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "baton.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "baton.selectorLabels" -}}
app.kubernetes.io/name: {{ include "baton.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "baton.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "baton.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "baton.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "baton.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "baton.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* KubeRay names the head's Service <raycluster>-head-svc; Ray's GCS listens on 6379. */}}
{{- define "baton.rayHeadAddress" -}}
{{- printf "%s-head-svc.%s.svc:6379" (include "baton.fullname" .) .Release.Namespace -}}
{{- end -}}

{{- define "baton.autoscaling" -}}
{{- if .Values.autoscaling.enabled -}}{{ .Values.autoscaling.mode }}{{- else -}}none{{- end -}}
{{- end -}}

{{/*
The effective worker groups, as a JSON list: the three role groups then extraWorkerGroups,
each workerDefaults shallow-overridden by the group's own keys (a key given replaces the
default wholesale, zero values included). Disabled groups are dropped.
*/}}
{{- define "baton.workerGroups" -}}
{{- $groups := list -}}
{{- $seen := dict -}}
{{- $candidates := list -}}
{{- range $role := list "prefill" "decode" "encode" -}}
{{- $g := deepCopy (index $.Values $role) -}}
{{- $_ := set $g "name" $role -}}
{{- $_ := set $g "role" $role -}}
{{- $candidates = append $candidates $g -}}
{{- end -}}
{{- range $.Values.extraWorkerGroups -}}
{{- $candidates = append $candidates (deepCopy .) -}}
{{- end -}}
{{- range $g := $candidates -}}
{{- if (hasKey $g "enabled" | ternary $g.enabled true) -}}
{{- if hasKey $seen $g.name -}}
{{- fail (printf "worker group name %q is used twice" $g.name) -}}
{{- end -}}
{{- $_ := set $seen $g.name true -}}
{{- $eff := deepCopy $.Values.workerDefaults -}}
{{- range $k, $v := $g -}}
{{- $_ := set $eff $k $v -}}
{{- end -}}
{{- range $k := list "replicas" "minReplicas" "maxReplicas" -}}
{{- if not (hasKey $eff $k) -}}{{- $_ := set $eff $k 1 -}}{{- end -}}
{{- end -}}
{{- if gt (int $eff.minReplicas) (int $eff.maxReplicas) -}}
{{- fail (printf "worker group %q: minReplicas (%v) > maxReplicas (%v)" $eff.name $eff.minReplicas $eff.maxReplicas) -}}
{{- end -}}
{{- $groups = append $groups $eff -}}
{{- end -}}
{{- end -}}
{{- toJson $groups -}}
{{- end -}}

{{/* Pods a group starts with: replicas, or minReplicas when an autoscaler owns the count. */}}
{{- define "baton.groupInitialPods" -}}
{{- if .root.Values.autoscaling.enabled -}}{{ int .group.minReplicas }}{{- else -}}{{ int .group.replicas }}{{- end -}}
{{- end -}}

{{/* Ray's --resources value: the role's custom resource, one unit per worker actor. */}}
{{- define "baton.rayResources" -}}
{{- toJson (dict .role (int .workersPerPod)) -}}
{{- end -}}

{{/* The model folder Baton loads, given model.source. */}}
{{- define "baton.modelName" -}}
{{- if eq .Values.model.source "none" -}}
{{- .Values.config.model.name -}}
{{- else -}}
{{- trimSuffix "/" (printf "%s/%s" .Values.model.mountPath .Values.model.path) -}}
{{- end -}}
{{- end -}}

{{/*
Container resources: requests and limits from `resources`, with GPUs (and RDMA when asked)
set to the same count in both, as device plugins require.
args: dict "resources" "gpus" "rdma" (the rdma values, or nil)
*/}}
{{- define "baton.containerResources" -}}
{{- $req := deepCopy (default dict .resources.requests) -}}
{{- $lim := deepCopy (default dict .resources.limits) -}}
{{- if gt (int .gpus) 0 -}}
{{- $_ := set $req "nvidia.com/gpu" (toString (int .gpus)) -}}
{{- $_ := set $lim "nvidia.com/gpu" (toString (int .gpus)) -}}
{{- end -}}
{{- if and .rdma .rdma.enabled -}}
{{- $_ := set $req .rdma.resourceName (toString (int .rdma.count)) -}}
{{- $_ := set $lim .rdma.resourceName (toString (int .rdma.count)) -}}
{{- end -}}
{{- toYaml (dict "requests" $req "limits" $lim) -}}
{{- end -}}

{{/* Container security context; IPC_LOCK is added for RDMA memory registration. */}}
{{- define "baton.containerSecurityContext" -}}
{{- $ctx := deepCopy .root.Values.containerSecurityContext -}}
{{- if and .worker .root.Values.rdma.enabled .root.Values.rdma.ipcLock -}}
{{- $caps := default dict $ctx.capabilities -}}
{{- $_ := set $caps "add" (append (default list $caps.add) "IPC_LOCK" | uniq) -}}
{{- $_ := set $ctx "capabilities" $caps -}}
{{- end -}}
{{- toYaml $ctx -}}
{{- end -}}

{{/* Env shared by every Baton container: identity from the downward API, NIXL/UCX. */}}
{{- define "baton.commonEnv" -}}
{{- $v := .root.Values -}}
- name: BATON_ROLE
  value: {{ .role | quote }}
- name: BATON_POD_NAME
  valueFrom: {fieldRef: {fieldPath: metadata.name}}
- name: BATON_POD_NAMESPACE
  valueFrom: {fieldRef: {fieldPath: metadata.namespace}}
- name: BATON_POD_IP
  valueFrom: {fieldRef: {fieldPath: status.podIP}}
- name: VLLM_NIXL_SIDE_CHANNEL_HOST
  valueFrom: {fieldRef: {fieldPath: status.podIP}}
- name: VLLM_NIXL_SIDE_CHANNEL_PORT
  value: {{ $v.nixl.sideChannelPort | quote }}
{{- if $v.nixl.ucxTls }}
- name: UCX_TLS
  value: {{ $v.nixl.ucxTls | quote }}
{{- end }}
{{- if $v.nixl.ucxNetDevices }}
- name: UCX_NET_DEVICES
  value: {{ $v.nixl.ucxNetDevices | quote }}
{{- end }}
- name: HF_HOME
  value: /tmp/hf
{{- if $v.rayAuth.enabled }}
- name: RAY_AUTH_MODE
  value: token
- name: RAY_AUTH_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "baton.rayTokenSecret" .root }}
      key: {{ $v.rayAuth.key }}
{{- end }}
{{- with $v.nixl.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- with $v.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- with .extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Volumes of every pod: /dev/shm (memory), the ClusterConfig, the model, extras. */}}
{{- define "baton.volumes" -}}
{{- $v := .root.Values -}}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ default $v.shm.sizeLimit .shmSizeLimit }}
- name: config
  configMap:
    name: {{ include "baton.fullname" .root }}-config
- name: tmp
  emptyDir: {}
{{- if eq $v.model.source "pvc" }}
- name: model
  persistentVolumeClaim:
    claimName: {{ required "model.pvc.claimName is required when model.source=pvc" $v.model.pvc.claimName }}
    readOnly: true
{{- else if eq $v.model.source "hostPath" }}
- name: model
  hostPath:
    path: {{ required "model.hostPath.path is required when model.source=hostPath" $v.model.hostPath.path }}
    {{- with $v.model.hostPath.type }}
    type: {{ . }}
    {{- end }}
{{- else if eq $v.model.source "download" }}
- name: model
  emptyDir:
    sizeLimit: {{ $v.model.download.sizeLimit }}
{{- end }}
{{- with .extraVolumes }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "baton.volumeMounts" -}}
{{- $v := .root.Values -}}
- name: dshm
  mountPath: /dev/shm
- name: config
  mountPath: /etc/baton
  readOnly: true
- name: tmp
  mountPath: /tmp
{{- if ne $v.model.source "none" }}
- name: model
  mountPath: {{ $v.model.mountPath }}
  readOnly: true
{{- end }}
{{- with .extraVolumeMounts }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* The init container that downloads the weights (model.source=download). */}}
{{- define "baton.initContainers" -}}
{{- $v := .root.Values -}}
{{- if eq $v.model.source "download" }}
- name: download-model
  image: {{ include "baton.image" .root }}
  imagePullPolicy: {{ $v.image.pullPolicy }}
  command: ["python", "-c"]
  args:
    - |
      import os
      from huggingface_hub import snapshot_download
      snapshot_download(os.environ["MODEL_REPO_ID"], revision=os.environ["MODEL_REVISION"],
                        local_dir=os.environ["MODEL_DIR"])
  env:
    - name: MODEL_REPO_ID
      value: {{ required "model.download.repoId is required when model.source=download" $v.model.download.repoId | quote }}
    - name: MODEL_REVISION
      value: {{ $v.model.download.revision | quote }}
    - name: MODEL_DIR
      value: {{ include "baton.modelName" .root | quote }}
    - name: HF_HOME
      value: /tmp/hf
    {{- if $v.model.download.tokenSecret.name }}
    - name: HF_TOKEN
      valueFrom:
        secretKeyRef:
          name: {{ $v.model.download.tokenSecret.name }}
          key: {{ $v.model.download.tokenSecret.key }}
    {{- end }}
  resources:
    {{- toYaml $v.model.download.resources | nindent 4 }}
  securityContext:
    {{- include "baton.containerSecurityContext" (dict "root" .root "worker" false) | nindent 4 }}
  volumeMounts:
    - name: model
      mountPath: {{ $v.model.mountPath }}
    - name: tmp
      mountPath: /tmp
{{- end }}
{{- end -}}

{{/* Pod-level fields shared by head and worker pods. */}}
{{- define "baton.podCommon" -}}
{{- $v := .root.Values -}}
serviceAccountName: {{ include "baton.serviceAccountName" .root }}
{{- /* Only the head talks to the API server, and only for the Ray autoscaler. */}}
automountServiceAccountToken: {{ and .apiAccess (eq (include "baton.autoscaling" .root) "ray") | ternary "true" "false" }}
{{- with $v.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $v.runtimeClassName }}
runtimeClassName: {{ . }}
{{- end }}
{{- with $v.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
securityContext:
  {{- toYaml $v.podSecurityContext | nindent 2 }}
terminationGracePeriodSeconds: {{ int .terminationGracePeriodSeconds }}
{{- with .nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* The Secret holding the Ray auth token: the given one, or the chart's own. */}}
{{- define "baton.rayTokenSecret" -}}
{{- default (printf "%s-ray-token" (include "baton.fullname" .)) .Values.rayAuth.existingSecret -}}
{{- end -}}

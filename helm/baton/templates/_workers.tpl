{{/*
The pod template of one worker group.
args: dict "root" $ "group" <effective group> "standalone" <bool>
standalone=false: a KubeRay worker group; KubeRay generates `ray start` (read from
KUBERAY_GEN_RAY_START_CMD, since the RayCluster overrides container commands).
standalone=true: a Deployment's pod (autoscaling.mode=keda) that joins the head itself.
*/}}
{{- define "baton.workerPodTemplate" -}}
{{- $v := .root.Values -}}
{{- $g := .group -}}
metadata:
  labels:
    {{- include "baton.selectorLabels" .root | nindent 4 }}
    app.kubernetes.io/component: worker
    baton.io/role: {{ $g.role }}
    baton.io/group: {{ $g.name }}
    {{- with $g.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  annotations:
    checksum/config: {{ include (print .root.Template.BasePath "/configmap.yaml") .root | sha256sum }}
    {{- with $g.podAnnotations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  {{- include "baton.podCommon" (merge (dict "root" .root "apiAccess" false) $g) | nindent 2 }}
  {{- if $v.rdma.hostNetwork }}
  hostNetwork: true
  dnsPolicy: ClusterFirstWithHostNet
  {{- end }}
  {{- with (include "baton.initContainers" .) }}
  initContainers:
    {{- . | nindent 4 }}
  {{- end }}
  containers:
    - name: ray-worker
      image: {{ include "baton.image" .root }}
      imagePullPolicy: {{ $v.image.pullPolicy }}
      command: ["/bin/bash", "-c", "--"]
      {{- if .standalone }}
      args:
        - >-
          ulimit -n 65536 || true;
          exec ray start --block --disable-usage-stats
          --address={{ include "baton.rayHeadAddress" .root }}
          --node-ip-address="${BATON_POD_IP}"
          --num-gpus={{ int $g.gpus }}
          --resources='{{ include "baton.rayResources" (dict "role" $g.role "workersPerPod" $g.workersPerPod) }}'
      {{- else }}
      args:
        - 'ulimit -n 65536 || true; eval "exec ${KUBERAY_GEN_RAY_START_CMD/--block/} --block"'
      {{- end }}
      env:
        {{- include "baton.commonEnv" (dict "root" .root "role" $g.role "extraEnv" $g.extraEnv) | nindent 8 }}
      ports:
        - name: nixl-side
          containerPort: {{ int $v.nixl.sideChannelPort }}
          protocol: TCP
      resources:
        {{- include "baton.containerResources" (dict "resources" $g.resources "gpus" $g.gpus "rdma" $v.rdma) | nindent 8 }}
      securityContext:
        {{- include "baton.containerSecurityContext" (dict "root" .root "worker" true) | nindent 8 }}
      volumeMounts:
        {{- include "baton.volumeMounts" (dict "root" .root "extraVolumeMounts" $g.extraVolumeMounts) | nindent 8 }}
  volumes:
    {{- include "baton.volumes" (dict "root" .root "shmSizeLimit" $g.shmSizeLimit "extraVolumes" $g.extraVolumes) | nindent 4 }}
{{- end -}}

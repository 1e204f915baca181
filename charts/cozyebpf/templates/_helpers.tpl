{{/* The chart's name: nameOverride, else cozyebpf. */}}
{{- define "cozyebpf.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Every object's name: fullnameOverride, else the release name (release-chart when the
two differ), as cozy-proxy's chart. */}}
{{- define "cozyebpf.fullname" -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else if eq .Release.Name $name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* The pods' selector: the name alone (kubectl -l app.kubernetes.io/name=cozyebpf, the
PodMonitor and deploy/uninstall/ select by it; a DaemonSet's selector cannot change). */}}
{{- define "cozyebpf.selectorLabels" -}}
app.kubernetes.io/name: {{ include "cozyebpf.name" . }}
{{- end -}}

{{- define "cozyebpf.labels" -}}
{{ include "cozyebpf.selectorLabels" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "cozyebpf.serviceAccountName" -}}
{{- default (include "cozyebpf.fullname" .) .Values.serviceAccountName -}}
{{- end -}}

{{- define "cozyebpf.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (toString .Values.image.tag) -}}
{{- end -}}
{{- end -}}

{{/* HOST:PORT of the metrics server; $(NODE_IP) is the container's variable from
status.hostIP. */}}
{{- define "cozyebpf.metricsAddress" -}}
{{- printf "%s:%v" (default "$(NODE_IP)" .Values.metrics.host) .Values.metrics.port -}}
{{- end -}}

{{/* The agent's memory, computed from agent.maxServices and agent.countedServices unless
daemonset.resources is set: the measured constants and the formula, the one place of both
(tests/unit/test_chart.py holds the constants to the figures bench/memory.json records; bytes).
- agentBase: the agent before any Service (interpreter, modules, metrics); agentPerService and
  agentPeakPerService: its RSS after the first sync and its peak, per Service (measured at
  100,000 Services; the caches of a cluster at maxServices);
- compilerChild: bcc's child at start, 3-4 s, then it exits (deploy/README.md, Resources);
- mapsPerService: the pinned maps' kernel memory per Service of maxServices (memlock of each
  map but svcstats); counterPerSlot and counterPerSlotCpu: svcstats (a per-CPU array) per
  counted Service, counterBudget what it may take when agent.countedServices is null (the
  agent's default), counterCpus the CPUs assumed when it is set;
- warnPercent: the agent warns above 85 % of its limit and resolves below 80: the steady state
  at maxServices stays below it.
request = agentBase + agentPerService x maxServices + maps + counters;
limit = max(agentBase + agentPeakPerService x maxServices + compilerChild + maps + counters,
            request x 100 / warnPercent), the request rounded up to a MiB before (so that the
            rounded request stays within warnPercent of the limit); the limit rounded up too. */}}
{{- define "cozyebpf.memoryConstants" -}}
agentBase: 41943040
agentPerService: 4000
agentPeakPerService: 4700
compilerChild: 230686720
mapsPerService: 2450
counterPerSlot: 16
counterPerSlotCpu: 160
counterBudget: 67108864
counterCpus: 32
warnPercent: 80
{{- end -}}

{{- define "cozyebpf.resources" -}}
{{- if .Values.daemonset.resources -}}
{{- toYaml .Values.daemonset.resources -}}
{{- else -}}
{{- $c := include "cozyebpf.memoryConstants" . | fromYaml -}}
{{- $n := int64 .Values.agent.maxServices -}}
{{- $counters := int64 $c.counterBudget -}}
{{- if not (kindIs "invalid" .Values.agent.countedServices) -}}
{{- $counters = mul (int64 .Values.agent.countedServices) (add $c.counterPerSlot (mul $c.counterPerSlotCpu $c.counterCpus)) -}}
{{- end -}}
{{- $kernel := add (mul $c.mapsPerService $n) $counters -}}
{{- $request := add $c.agentBase (mul $c.agentPerService $n) $kernel -}}
{{- $peak := add $c.agentBase (mul $c.agentPeakPerService $n) $c.compilerChild $kernel -}}
{{- $mi := 1048576 -}}
{{- $requestMi := div (add $request (sub $mi 1)) $mi -}}
{{- $limit := max $peak (div (mul $requestMi $mi 100) $c.warnPercent) -}}
requests:
  cpu: 100m
  memory: {{ $requestMi }}Mi
limits:
  memory: {{ div (add $limit (sub $mi 1)) $mi }}Mi
{{- end -}}
{{- end -}}

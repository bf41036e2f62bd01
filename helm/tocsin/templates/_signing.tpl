{{/*
Signed callbacks (docs/proxy.md, "Verifying callbacks"): the proxy reads its tenants'
delivery secrets from a JSON file in an existing Secret (proxy.signing.existingSecret).
The Secret is mounted as a directory, never with subPath: the kubelet then swaps the file
in place when the Secret changes, and the proxy picks the new secrets up without a restart.
*/}}
{{- define "tocsin.proxySigningDir" -}}/etc/tocsin/callback-signing{{- end -}}

{{- define "tocsin.proxySigningEnv" -}}
{{- $s := .Values.proxy.signing -}}
{{- if $s.existingSecret }}
- name: TOCSIN_PROXY_SIGNING_SECRETS_FILE
  value: {{ printf "%s/%s" (include "tocsin.proxySigningDir" .) $s.key | quote }}
- name: TOCSIN_PROXY_REQUIRE_SIGNATURE
  value: {{ $s.required | toString | quote }}
{{- else if $s.required }}
{{- fail "proxy.signing.required needs proxy.signing.existingSecret (the Secret holding the delivery secrets file)" }}
{{- end }}
{{- end -}}

{{- define "tocsin.proxySigningVolumes" -}}
{{- with .Values.proxy.signing.existingSecret }}
- name: callback-signing
  secret:
    secretName: {{ . }}
    defaultMode: 0440
{{- end }}
{{- end -}}

{{- define "tocsin.proxySigningMounts" -}}
{{- if .Values.proxy.signing.existingSecret }}
- name: callback-signing
  mountPath: {{ include "tocsin.proxySigningDir" . }}
  readOnly: true
{{- end }}
{{- end -}}

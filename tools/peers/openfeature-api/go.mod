// A stand-in, written here, for the three names flagd's Kubernetes source takes from the
// OpenFeature Operator's api module (GroupVersion, AddToScheme, FeatureFlag), which the Go
// module proxy does not serve: every version of that module's source is refused there. The
// FeatureFlag's spec is kept as the JSON object the API server holds, so flagd syncs exactly
// what the CR says. flagd's gRPC source, which the tests run, does not use it.
module github.com/open-feature/open-feature-operator/api

go 1.26.0

require k8s.io/apimachinery v0.33.2

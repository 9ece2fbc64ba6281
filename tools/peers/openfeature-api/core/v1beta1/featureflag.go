// Package v1beta1 holds the FeatureFlag kind of core.openfeature.dev/v1beta1 as flagd's
// Kubernetes source reads it: metadata, and the flag configuration under spec.flagSpec kept
// as the JSON object the API server holds.
package v1beta1

import (
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
)

// GroupVersion is the group and version of the OpenFeature Operator's core kinds.
var GroupVersion = schema.GroupVersion{Group: "core.openfeature.dev", Version: "v1beta1"}

// AddToScheme registers FeatureFlag and FeatureFlagList under GroupVersion.
func AddToScheme(s *runtime.Scheme) error {
	s.AddKnownTypes(GroupVersion, &FeatureFlag{}, &FeatureFlagList{})
	metav1.AddToGroupVersion(s, GroupVersion)
	return nil
}

// FeatureFlag is one FeatureFlag resource.
type FeatureFlag struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`
	Spec              FeatureFlagSpec `json:"spec,omitempty"`
}

// FeatureFlagSpec holds the flag configuration.
type FeatureFlagSpec struct {
	// FlagSpec is flagd's flag configuration ({"flags": …, "$evaluators": …}) as written.
	FlagSpec map[string]interface{} `json:"flagSpec,omitempty"`
}

// FeatureFlagList is a list of FeatureFlags.
type FeatureFlagList struct {
	metav1.TypeMeta `json:",inline"`
	metav1.ListMeta `json:"metadata,omitempty"`
	Items           []FeatureFlag `json:"items"`
}

// DeepCopyObject copies the FeatureFlag, its spec included.
func (in *FeatureFlag) DeepCopyObject() runtime.Object {
	out := &FeatureFlag{TypeMeta: in.TypeMeta}
	in.ObjectMeta.DeepCopyInto(&out.ObjectMeta)
	out.Spec.FlagSpec = runtime.DeepCopyJSON(in.Spec.FlagSpec)
	return out
}

// DeepCopyObject copies the list and every item.
func (in *FeatureFlagList) DeepCopyObject() runtime.Object {
	out := &FeatureFlagList{TypeMeta: in.TypeMeta}
	in.ListMeta.DeepCopyInto(&out.ListMeta)
	for i := range in.Items {
		out.Items = append(out.Items, *in.Items[i].DeepCopyObject().(*FeatureFlag))
	}
	return out
}
